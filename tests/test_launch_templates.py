"""Every shipped launch command runs: it validates for the processes and devices it starts, and
its train state fits device memory (issue 24, point 9), and so do the train and bench lines of
README.md and docs/ (issue 39). Also: a big model with no data named
stops at validation with one line saying which data keys to set."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from maxmoe.cli import main
from maxmoe.cluster import load_cluster
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.plan.estimate import state_bytes
from maxmoe.validation import validate

ROOT = Path(__file__).resolve().parents[1]
# The GPU templates run on H800s (k8s: configs/experiments/deepseek_v3_2048xh800.yaml; slurm: the
# same 80 GB parts): the train state must fit their usable memory (configs/devices/h800.yaml's
# memory_gib x usable_fraction; the rest: activations, NCCL, XLA's workspace).
GPU_STATE_BYTES = load_cluster("8xh800").usable_bytes
CPU_HOST_BYTES = 8 * 2**30  # shared by the fake CPU devices of one laptop-sized host


def slurm_commands() -> list[dict]:
    """The usage line `sbatch launch/slurm.sbatch ARGS`, on #SBATCH --nodes x --gpus-per-node."""
    text = (ROOT / "launch" / "slurm.sbatch").read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M).group(1))
    usage = re.findall(r"^#\s+sbatch launch/slurm\.sbatch (.+)$", text, re.M)
    assert len(usage) == 1, usage
    return [dict(where="launch/slurm.sbatch", verb="train", args=shlex.split(usage[0]),
                 processes=nodes, devices=nodes * gpus, memory=GPU_STATE_BYTES)]


def jobset_commands() -> list[dict]:
    """The container command of each replicated job, on its pods x GPUs per pod."""
    spec = yaml.safe_load((ROOT / "launch" / "k8s_jobset.yaml").read_text())["spec"]
    out = []
    for job in spec["replicatedJobs"]:
        template = job["template"]["spec"]
        pods = job["replicas"] * template["parallelism"]
        assert template["completions"] == template["parallelism"], "keep NUM_NODES equal"
        (container,) = template["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert int(env["MAXMOE_NUM_PROCESSES"]) == pods, "MAXMOE_NUM_PROCESSES != pods"
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        maxmoe, verb, *args = container["command"]
        assert maxmoe == "maxmoe"
        out.append(dict(where="launch/k8s_jobset.yaml", verb=verb, args=args, processes=pods,
                        devices=pods * gpus, memory=GPU_STATE_BYTES))
    return out


def local_commands() -> list[dict]:
    """The usage line `launch/local_multiprocess.sh N VERB ARGS` (N processes on this CPU)."""
    text = (ROOT / "launch" / "local_multiprocess.sh").read_text()
    (usage,) = re.findall(r"^#\s+launch/local_multiprocess\.sh (.+)$", text, re.M)
    n, verb, *args = shlex.split(usage)
    cfg, _ = load_config([a for a in args if "=" not in a], [a for a in args if "=" in a])
    return [dict(where="launch/local_multiprocess.sh", verb=verb, args=args, processes=int(n),
                 devices=int(n) * (cfg.mesh.cpu_devices or 1),
                 memory=CPU_HOST_BYTES // (cfg.mesh.cpu_devices or 1))]


def doc_commands() -> list[dict]:
    """Every `maxmoe train|bench ...` in a code block of README.md or docs/ that names a config
    (one CPU process, the config's fake device count), those tests/test_doc_examples.py does not
    run too; a bench --sweep gives one command per value."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        out += code_block_commands(path)
    return out


def code_block_commands(path: Path) -> list[dict]:
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", path.read_text(), re.M | re.S)
    out = []
    for line in (line for block in blocks for line in block.splitlines()):
        found = re.search(r"(?:^|&&\s*)maxmoe (train|bench) (.*)$", line)
        if not found:
            continue
        words, items, sweep = shlex.split(found.group(2), comments=True), [], [""]
        while words:
            word = words.pop(0)
            if word == "--dry-run":
                continue
            if word == "--sweep":
                key, values = words.pop(0).split("=", 1)
                sweep = [f"{key}={v}" for v in values.split(",")]
            elif word.startswith("--"):
                words.pop(0)  # --steps N, --profile DIR
            else:
                items.append(word)
        if not any(item.endswith(".yaml") for item in items):
            continue
        for extra in sweep:
            args = items + ([extra] if extra else [])
            cfg, _ = load_config([a for a in args if "=" not in a], [a for a in args if "=" in a])
            where = f"{path.relative_to(ROOT)}: {line.strip()}"
            out.append(dict(where=where, verb=found.group(1), args=args,
                            processes=1, devices=cfg.mesh.cpu_devices or 1,
                            memory=CPU_HOST_BYTES // (cfg.mesh.cpu_devices or 1)))
    return out


COMMANDS = slurm_commands() + jobset_commands() + local_commands() + doc_commands()


def test_every_source_of_commands_is_read():
    wheres = {c["where"].split(":")[0] for c in COMMANDS}
    assert {"launch/slurm.sbatch", "launch/k8s_jobset.yaml", "launch/local_multiprocess.sh",
            "README.md"} <= wheres
    assert sum(".md: " in c["where"] for c in COMMANDS) >= 5


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c['where']} {' '.join(c['args'])}")
def test_launch_command_validates_and_its_state_fits(command):
    args = command["args"]
    cfg, origins = load_config([a for a in args if "=" not in a], [a for a in args if "=" in a])
    try:
        sizes = validate(cfg, command["devices"], origins, command["processes"],
                         reads_data=command["verb"] == "train")
    except ConfigError as error:
        pytest.fail(f"{command['where']} on {command['processes']} processes x "
                    f"{command['devices']} devices: {error}")
    estimate = state_bytes(cfg, sizes)
    # the state, plus the step's gradients (as large as the params) held beside it
    held = estimate.total + estimate.grads
    assert held <= command["memory"], (
        f"{command['where']}: {held / 2**30:.1f} GiB of state and gradients per device > "
        f"{command['memory'] / 2**30:.1f} GiB")


V3 = "configs/models/deepseek_v3_671b.yaml"


def test_a_big_model_with_no_data_stops_with_the_keys_to_set(capsys):
    assert main(["train", V3, "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("maxmoe: error: config key 'data.source'"), err
    for key in ("data.source", "data.mixture", "data.tokenizer_dir", "model.vocab_size=129280"):
        assert key in err, (key, err)


@pytest.mark.parametrize("data", ["data.source=/shared/data/web", "data.tokenizer_dir=/tok",
                                  "data.mixture=/a:0.5,/b:0.5"])
def test_a_big_model_with_data_named_passes_the_data_check(data):
    cfg, origins = load_config([V3], [data])
    validate(cfg, 1, origins, reads_data=True)
    cfg, origins = load_config([V3])
    validate(cfg, 1, origins)  # bench, plan: synthetic batches, no data to check


@pytest.mark.parametrize("files", [
    ["configs/tiny.yaml"],
    *[["configs/tiny.yaml", str(p.relative_to(ROOT))]
      for p in sorted((ROOT / "configs" / "models").glob("tiny_*.yaml"))],
    ["configs/bench/cpu_mixtral_tiny.yaml"],
    ["configs/bench/h200_deepseek_1b.yaml"],  # tools/gpu_check.sh trains it on the stdlib
])
def test_small_models_still_train_on_the_stdlib(files):
    cfg, origins = load_config(files)
    assert cfg.data.source == "stdlib"
    validate(cfg, cfg.mesh.cpu_devices or 1, origins, reads_data=True)
