"""The set-up `maxmoe train` and `maxmoe bench` share: mesh, trainer, model FLOPs per step and
the start-up lines, built one way so the two report the same figures.

Imports no data pipeline (grain): `maxmoe bench` runs where it is not installed.
"""

from __future__ import annotations

import dataclasses

from maxmoe.config import Config
from maxmoe.metrics.flops import flops_per_token
from maxmoe.model.spec import describe_pipeline
from maxmoe.parallel.dispatch import describe_transport
from maxmoe.sharding import make_mesh
from maxmoe.train.step import Trainer, make_trainer
from maxmoe.validation import dcn_sizes


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """One config on its mesh: the trainer and the figures derived from the config alone."""
    cfg: Config
    mesh_sizes: dict[str, int]  # mesh axis -> size, as validation returned it
    trainer: Trainer
    tokens_per_step: int  # global batch x sequence length
    model_flops: float  # per step, metrics.flops.FLOP_CONVENTION

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The axes with more than one device (what start-up lines and bench results show)."""
        return {k: v for k, v in self.mesh_sizes.items() if v > 1}

    @property
    def pipeline_line(self) -> str | None:
        """The pipeline's start-up line (layers pipelined, bubble), None without stages."""
        return describe_pipeline(self.cfg.model, self.mesh_sizes["pipeline"])

    @property
    def transport_line(self) -> str | None:
        """The MoE dispatch's start-up line (transport and why), None without an expert axis."""
        return describe_transport(self.cfg, self.mesh_sizes)


def prepare_run(cfg: Config, mesh_sizes: dict[str, int], devices=None) -> RunSetup:
    """Builds the mesh (ICI x DCN) and the trainer of a validated config; compiles nothing.
    devices: the mesh's devices (default jax.devices(); `maxmoe plan --compiler gpu` passes
    deviceless GPUs)."""
    trainer = make_trainer(cfg, make_mesh(mesh_sizes, devices=devices, dcn=dcn_sizes(cfg)))
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    return RunSetup(cfg, mesh_sizes, trainer, tokens, flops_per_token(cfg) * tokens)
