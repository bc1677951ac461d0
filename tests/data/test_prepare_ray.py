"""`maxmoe data prepare --executor ray` end to end on a local Ray cluster (2 CPUs, a bounded
object store, nothing outside this machine): the same shards as the local executor, shards a
training run reads, and a task that dies mid-run and reruns alone to the same output.

The task dies by an exception: a worker process killed outright (os._exit, as an OOM kill)
leaves datatrove 0.10.1's RayPipelineExecutor waiting on the lost task forever (Ray 2.60,
checked 2026-12-07), so that case is not tested here."""

import json
import os
import sys

import numpy as np
import pytest
import ray

from maxmoe.config import DataConfig
from maxmoe.data import stages as stages_module
from maxmoe.data.executors import LaunchOptions
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.prepare import PrepareOptions, prepare
from maxmoe.data.tokenizer import load_tokenizer

from .test_prepare import _outputs, _written, planted  # noqa: F401 -- planted: a fixture


class KillOnce(stages_module.PipelineStep):
    """Passes documents on; task 1's first run dies after 20 of them. Every run of a task
    leaves a file runs/RANK-N behind."""

    name = "test kill once"

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def run(self, data, rank=0, world_size=1):
        os.makedirs(self.folder, exist_ok=True)
        runs = sum(name.startswith(f"{rank}-") for name in os.listdir(self.folder))
        open(os.path.join(self.folder, f"{rank}-{runs}"), "w").close()
        for count, doc in enumerate(data):
            if rank == 1 and runs == 0 and count == 20:
                raise RuntimeError("task 1 dies mid-run")
            yield doc


@pytest.mark.slow
def test_ray_matches_local_and_reruns_a_killed_task(planted, tokenizer_dir, tokenizer,  # noqa: F811
                                                    tmp_path, monkeypatch):
    root, originals, edited = planted
    options = PrepareOptions(tasks=2, validation_fraction=0.1, launch=LaunchOptions(workers=1))
    reference = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "local"), options)

    real_build = stages_module.build_stages

    def with_kill(files, out, opts):
        stages = real_build(files, out, opts)
        write = next(s for s in stages if s.name == "write")
        write.pipeline.insert(-1, KillOnce(str(tmp_path / "runs")))  # before the shard writer
        return stages

    monkeypatch.setattr(stages_module, "build_stages", with_kill)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # KillOnce, in the tasks
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False,
             log_to_driver=False)
    launch = LaunchOptions(executor="ray", memory_gb_per_task=0.5)
    ray_options = PrepareOptions(**{**options.__dict__, "launch": launch})
    try:
        with pytest.raises(RuntimeError, match=r"stage write: tasks \[1\] failed"):
            prepare([str(root)], str(tokenizer_dir), str(tmp_path / "ray"), ray_options)
        assert sorted(os.listdir(tmp_path / "runs")) == ["0-0", "1-0"]
        assert not (tmp_path / "ray" / "manifest.json").exists()
        # the same command again: every finished task is skipped, task 1 of write reruns
        manifest = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "ray"), ray_options)
    finally:
        ray.shutdown()
    assert sorted(os.listdir(tmp_path / "runs")) == ["0-0", "1-0", "1-1"]
    assert {k: v for k, v in manifest.items() if k != "inputs"} == \
        {k: v for k, v in reference.items() if k != "inputs"}
    assert _outputs(tmp_path / "ray") == _outputs(tmp_path / "local")
    written = _written(tmp_path / "ray", tokenizer)
    assert len(written) == len(set(written)) == 200  # one survivor of each planted cluster
    assert manifest["dropped"]["exact_duplicate"] == 10
    assert json.loads((tmp_path / "ray" / "settings.json").read_text())["options"]["tasks"] == 2

    # what a training run reads: rows packed from the prepared documents (a row of the first
    # batch starts at a document: its first tokens decode to the start of a survivor)
    cfg = DataConfig(source=str(tmp_path / "ray"), seq_len=128, global_batch_size=2,
                     streams=1, prefetch_batches=1)
    loaded = load_tokenizer(cfg, tokenizer.vocab_size)
    batch = next(iter(make_dataset(cfg, loaded)))
    start = loaded.decode(np.asarray(batch["tokens"][0][:32]))
    assert len(start) > 20 and any(text.startswith(start) for text in written)
