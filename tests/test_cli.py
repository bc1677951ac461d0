"""The command line as a user runs it: help, one-line errors with exit code 2, no traceback."""

import subprocess
import sys

import pytest

from maxmoe.cli import main


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "maxmoe.cli", *args], capture_output=True,
                          check=False, text=True, cwd=cwd, timeout=300)


def test_help_lists_train():
    out = run_cli("--help")
    assert out.returncode == 0 and "train" in out.stdout
    out = run_cli("train", "--help")
    assert out.returncode == 0 and "KEY=VALUE" in out.stdout and "resumes" in out.stdout


@pytest.mark.parametrize("args, expected", [
    (["configs/tiny.yaml", "moe.experts_per_token=9"],
     "config key 'moe.experts_per_token' = 9 (from command line): top-k cannot exceed"),
    (["configs/tiny.yaml", "mesh.data=4"], "config key 'mesh.data' = 4 (from command line)"),
    (["configs/tiny.yaml", "model.hidden_sise=4"], "config key 'model.hidden_sise'"),
    (["configs/tiny.yaml", "train.steps=many"], "expected int, got str"),
    (["configs/nope.yaml"], "config file 'configs/nope.yaml': not found"),
    (["configs/tiny.yaml", "attention.num_kv_heads=3"], "must divide attention.num_heads"),
])
def test_bad_input_is_one_line_exit_2(args, expected):
    out = run_cli("train", *args)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("maxmoe: error: "), out.stderr
    assert expected in lines[0]
    assert "Traceback" not in out.stderr


def test_error_names_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("moe:\n  num_experts: 6\nmesh:\n  data: 1\n  expert: 4\n")
    assert main(["train", "configs/tiny.yaml", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"config key 'moe.num_experts' = 6 (from {bad})" in err, err


HELP_ARGVS = [["--help"], ["train", "--help"], ["bench", "--help"], ["data", "--help"],
              ["data", "prepare", "--help"], ["convert", "to-hf", "--help"], ["forward", "--help"],
              ["eval", "--help"], ["report", "--help"], ["ckpt", "--help"],
              ["ckpt", "verify", "--help"]]


def test_help_imports_no_jax():
    """`maxmoe --help` and every verb's --help build the whole parser without importing JAX,
    so help comes back in a blink (the command modules import their library inside `run`)."""
    code = ("import sys\nfrom maxmoe.cli import main\n"
            f"for argv in {HELP_ARGVS!r}:\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, (argv, e.code)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_bare_command_prints_usage():
    out = run_cli()
    assert out.returncode == 2 and "usage" in out.stdout


@pytest.mark.parametrize("args, expected", [
    (["--sweep", "mesh.expert=2,3"], "config key 'mesh.expert' = 3"),
    (["--sweep", "moe.dispatch=dropless,capacity", "--profile", "/tmp/trace"],
     "--profile traces one config, --sweep times several"),
    (["--sweep", "moe.dispatch"], "--sweep expects KEY=V1,V2,..."),
])
def test_bad_sweep_is_refused_before_anything_compiles(args, expected, capsys):
    """Every swept value is checked first: the bad one (expert=3 on 8 devices) stops the sweep
    with exit 2 and no value timed."""
    assert main(["bench", "configs/tiny.yaml", *args]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and "step ms" not in captured.err and not captured.out


@pytest.mark.parametrize("steps", ["0", "-3", "ten"])
def test_bench_steps_must_be_a_positive_count(steps):
    out = run_cli("bench", "configs/tiny.yaml", "--steps", steps)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"argument --steps: '{steps}' is not a whole number of at least 1" in out.stderr
