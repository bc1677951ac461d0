"""Per-layer diagnostics computed inside the train step on logged steps (docs/observability.md):
update/param ratios per layer and gradient norms per parameter group. Pure functions of
param / gradient trees (layer groups stacked [L, ...] or per-layer trees under int keys with
model.scan_layers=false, then MTP depths)."""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import optax


def _squares(leaves: Iterable[jax.Array], stacked: bool) -> jax.Array:
    """Sum of squares in float32: [n] per layer of stacked [n, ...] leaves, else [1]."""
    return jnp.atleast_1d(sum(jnp.sum(jnp.square(x.astype(jnp.float32)),
                                      axis=tuple(range(int(stacked), x.ndim))) for x in leaves))


def update_ratios(new_params, params) -> jax.Array:
    """[L] |new - old| / |old| per decoder layer (layer groups in layer order; a group is
    stacked [L, ...] leaves, or per-layer trees under int keys with model.scan_layers=false),
    then per MTP depth (its block, projection and norms).

    From the applied change rather than optax's update tree: the update then has one reader
    (the new params) and XLA fuses it away instead of writing it out and reading it back for
    these sums (XLA:CPU has no multi-output fusion)."""
    def ratio(new, old, stacked: bool):
        new, old = jax.tree.leaves(new), jax.tree.leaves(old)
        u = _squares((n.astype(jnp.float32) - o.astype(jnp.float32)
                      for n, o in zip(new, old, strict=True)), stacked)
        return jnp.sqrt(u / jnp.maximum(_squares(old, stacked), 1e-30))

    ratios = []
    for group in sorted(params["layer_groups"]):
        new, old = new_params["layer_groups"][group], params["layer_groups"][group]
        if all(isinstance(k, int) for k in old):  # per-layer trees
            ratios += [ratio(new[j], old[j], stacked=False) for j in sorted(old)]
        else:
            ratios.append(ratio(new, old, stacked=True))
    for j in sorted(params.get("mtp", {})):
        ratios.append(ratio(new_params["mtp"][j], params["mtp"][j], stacked=False))
    return jnp.concatenate(ratios)


# grad_norm_by_group: a block's params by the top-level key they sit under (anything else, a
# group of its own name); a MoE MLP's by MOE_GROUPS, its routed experts (gate, up, down) under
# "experts"; a dense MLP's all under "dense_mlp"
BLOCK_GROUPS = {"attn": "attention", "attn_norm": "norms", "mlp_norm": "norms"}
MOE_GROUPS = {"router": "router", "shared": "shared"}
MTP_GROUPS = {"embed_norm": "norms", "hidden_norm": "norms", "final_norm": "norms",
              "projection": "mtp_projection"}


def _block_squares(block: dict, stacked: bool) -> dict[str, jax.Array]:
    """{group: squared gradient norm [n] (stacked [n, ...] leaves) or [1]} of one block."""
    out: dict[str, jax.Array] = {}

    def add(group: str, tree) -> None:
        out[group] = out.get(group, 0.0) + _squares(jax.tree.leaves(tree), stacked)

    for key, sub in block.items():
        if key == "mlp" and "router" in sub:
            for name, leaf in sub.items():
                add(MOE_GROUPS.get(name, "experts"), leaf)
        else:
            add("dense_mlp" if key == "mlp" else BLOCK_GROUPS.get(key, key), sub)
    return out


def grad_norms_by_group(grads) -> dict[str, jax.Array]:
    """Gradient norms per parameter group (docs/observability.md): per-layer groups [n] over the
    layers that have them, in layer order then MTP depths (attention, norms: [L]; router,
    experts, shared: [L_moe]; dense_mlp: [L_dense]; mtp_projection: [mtp_depth]), and scalars
    embedding and head (the LM head and the final norm)."""
    parts: list[dict[str, jax.Array]] = []
    for g in sorted(grads["layer_groups"]):
        group = grads["layer_groups"][g]
        if all(isinstance(k, int) for k in group):  # model.scan_layers=false
            parts += [_block_squares(group[j], stacked=False) for j in sorted(group)]
        else:
            parts.append(_block_squares(group, stacked=True))
    for j in sorted(grads.get("mtp", {})):
        layer = dict(grads["mtp"][j])
        part = _block_squares(layer.pop("block"), stacked=False)
        for key, sub in layer.items():
            group = MTP_GROUPS.get(key, key)
            sq = jnp.atleast_1d(optax.tree.norm(sub) ** 2)
            part[group] = part.get(group, 0.0) + sq
        parts.append(part)
    names = list(dict.fromkeys(name for part in parts for name in part))
    out = {name: jnp.sqrt(jnp.concatenate([p[name] for p in parts if name in p]))
           for name in names}
    out["embedding"] = optax.tree.norm(grads["embed"])
    out["head"] = optax.tree.norm({"lm_head": grads["lm_head"], "norm": grads["final_norm"]})
    return out
