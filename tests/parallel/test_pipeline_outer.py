"""Layers outside the pipeline are split over the stage axis too (issue 25 item 3).

The embedding, the dense prefix, the final norm + LM head + loss and MTP run outside the
pipeline. With the stage axis among the batch axes there (config.DEFAULT_RULES) each stage does
1/P of that work on 1/P of the rows; inside, `sharding.within_stages` takes the stage axes out
of "batch" again, so the stages see their microbatch rows as before. Before, every stage ran the
whole batch's outside work (the plans' figures: docs/performance/parallelism.md, "Pipeline
memory at scale"). The compiled step's temporaries against the old rules are checked in
tests/parallel/test_pipeline.py, which compiles that layout once for its replication check too.
"""

import jax
import pytest

from maxmoe.config import ConfigError
from maxmoe.sharding import make_mesh, mesh_axes, spec, use_mesh, within_stages
from maxmoe.validation import validate
from tests.helpers import small_config


def test_within_stages_drops_the_stage_axes_but_from_the_stage_dims():
    """Outside, "batch" spans the stage axis; inside, everything but "stage" / "layers" loses
    it (also a user's `embed` on [fsdp, pipeline]); on exit the outer rules are back."""
    cfg, origins = small_config("mesh.pipeline=2", "mesh.fsdp=2",
                                "mesh.rules.embed=[fsdp, pipeline]")
    with use_mesh(make_mesh(validate(cfg, 8, origins)), cfg.mesh.rules):
        assert mesh_axes("batch") == ("data", "fsdp", "pipeline")
        with within_stages():
            assert mesh_axes("batch") == ("data", "fsdp")
            assert mesh_axes("embed") == ("fsdp",)
            assert mesh_axes("stage") == mesh_axes("layers") == ("pipeline",)
            assert spec(("stage", "batch", "seq")) == jax.sharding.PartitionSpec(
                "pipeline", ("data", "fsdp"), None)
        assert spec(("batch", "seq")) == jax.sharding.PartitionSpec(
            ("data", "fsdp", "pipeline"), None)


def test_global_batch_must_split_over_the_stage_axis_too():
    """4 sequences on data 4 x pipeline 2 with 1 microbatch: a whole row per stage's batch
    shard (4 / 1 / 4), but not one per device outside the pipeline (4 / 8): one line."""
    cfg, origins = small_config("mesh.pipeline=2", "mesh.data=4",
                                "model.pipeline_microbatches=1", "data.global_batch_size=4")
    with pytest.raises(ConfigError) as err:
        validate(cfg, 8, origins)
    message = str(err.value)
    assert "data.global_batch_size" in message and "(8) over mesh axes ['data', 'pipeline']" in message, message
    assert "\n" not in message.strip()
