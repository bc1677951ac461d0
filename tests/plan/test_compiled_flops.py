"""plan/compiled_flops: the matmul FLOPs read from optimised HLO count loop bodies trip-count
times (XLA's cost_analysis counts them once), flag a dense expansion, leave custom calls out and
say so, and do not judge a step whose loops have data-dependent trip counts (XLA:CPU here)."""

import jax
import jax.numpy as jnp
import pytest

from maxmoe.plan.compiled_flops import check_line, flops_check, matmul_flops, xla_flops

B, D, LAYERS = 64, 128, 5
ONE_LAYER = 2 * B * D * D  # reference: one [B, D] @ [D, D] matmul


def _compiled(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.as_text(), compiled


def _scanned(x, w):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]


def test_loop_bodies_count_trip_count_times():
    hlo, compiled = _compiled(_scanned, (B, D), (LAYERS, D, D))
    tally = matmul_flops(hlo)
    assert tally.flops == LAYERS * ONE_LAYER and tally.loops_once == 0
    assert xla_flops(compiled) < 2 * ONE_LAYER  # XLA counts the scan's body once
    grads, compiled = _compiled(jax.grad(lambda x, w: _scanned(x, w).sum(), argnums=(0, 1)),
                                (B, D), (LAYERS, D, D))
    assert matmul_flops(grads).flops == 3 * LAYERS * ONE_LAYER  # forward, dx and dw a layer


def test_a_dense_ragged_dot_is_flagged_and_one_gemm_is_not():
    groups, rows = 8, 256

    def ragged(x, w):  # XLA:CPU runs every row through every group's weight
        return jax.lax.ragged_dot(x, w, jnp.full((groups,), rows // groups, jnp.int32))

    hlo, compiled = _compiled(ragged, (rows, D), (groups, D, D))
    model = 2 * rows * D * D  # what the grouped GEMM needs: each row through one group
    check = flops_check(hlo, compiled, model, 1.0)
    assert check["flag"] is True and check["verdict"] == "flagged"
    assert check["ratio"] == pytest.approx(groups)
    assert "FLAGGED" in check_line(check)
    hlo, compiled = _compiled(lambda x, w: x @ w, (rows, D), (D, D))
    check = flops_check(hlo, compiled, model, 1.0)
    assert (check["flag"], check["verdict"], check["ratio"]) == (False, "within", 1.0)
    assert flops_check(hlo, compiled, model / 1.3, 4 / 3)["flag"] is False  # remat allowance
    assert flops_check(hlo, compiled, model / 1.3, 1.0)["flag"] is True


def test_custom_calls_are_named_and_make_it_a_lower_bound():
    def top(x, w):  # lax.top_k is a TopK custom call on XLA:CPU
        return jax.lax.top_k(x @ w, 4)[0]

    hlo, compiled = _compiled(top, (B, D), (D, D))
    check = flops_check(hlo, compiled, ONE_LAYER, 1.0)
    assert check["uncounted_custom_calls"] == {"TopK": 1}
    assert check["verdict"] == "within (a lower bound)" and check["flag"] is False
    assert '"TopK": 1' in check_line(check)


def test_data_dependent_loops_are_not_judged():
    def loop(x, w, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ w, c[1] + 1),
                                  (x, 0))[0]

    args = (jax.ShapeDtypeStruct((B, D), jnp.float32), jax.ShapeDtypeStruct((D, D), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32))
    compiled = jax.jit(loop).lower(*args).compile()
    check = flops_check(compiled.as_text(), compiled, ONE_LAYER, 1.0)
    assert check["loops_counted_once"] == 1 and check["compiled_flops_per_device"] == ONE_LAYER
    assert check["flag"] is None and check["verdict"] == "not judged"
    assert "not judged: 1 loops" in check_line(check)
