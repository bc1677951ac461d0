"""Every `maxmoe ...` example in README.md and docs/**/*.md runs (issue 39 item 5), or says why
not: a line that exits non-zero on the quick-start run fails the test, named with its file and
line. Also: every verb has an example that runs, and the README's set-up commands are the ones
`.ci/run` runs. docs/index.md ("How the examples are tested") is the convention this reads."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from maxmoe.cli import COMMANDS, main
from maxmoe.config_files import load_config

ROOT = Path(__file__).resolve().parents[1]
# a shell comment with `not run: WHY` in it, or (table rows) <!-- not run: WHY -->
NOT_RUN = re.compile(r"#.*?\bnot run:\s*(.*\S)\s*$|<!--\s*not run:\s*(\S.*?)\s*-->")
COMMAND = re.compile(r"(?:^|&&\s*|^\$\s+)maxmoe\s+(\S.*)$")
INLINE = re.compile(r"`maxmoe\s+([^`]+)`")


@dataclass
class Example:
    where: str  # file:line
    words: list[str]  # after `maxmoe`, shell-split, comments dropped
    reason: str | None  # why it is not run, or None


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def joined(lines: list[str], i: int) -> tuple[str, int]:
    """Line i with its `\\` continuations, and the index after them."""
    text = lines[i].rstrip()
    while text.endswith("\\") and i + 1 < len(lines):
        i += 1
        text = text[:-1] + " " + lines[i].strip()
    return text, i + 1


def tagged(text: str, command: str) -> Example:
    found = NOT_RUN.search(text)
    reason = (found.group(1) or found.group(2)) if found else None
    if reason and reason.count(")") > reason.count("("):  # "# comment (not run: WHY)"
        reason = reason[:reason.rindex(")")].rstrip()
    return Example("", shlex.split(command, comments=True), reason)


def examples_in(path: Path) -> list[Example]:
    """Commands in fenced or indented code blocks (`maxmoe ...`, `$ maxmoe ...`, `... && maxmoe
    ...`), and in backticks in table rows when they have an argument (a path, KEY=VALUE or an
    option: the README's verb table). Prose is not read."""
    lines, out, fence, i = path.read_text().splitlines(), [], False, 0
    while i < len(lines):
        start, line = i, lines[i]
        if line.lstrip().startswith("```"):
            fence, i = not fence, i + 1
            continue
        found = []
        if fence or line.startswith("    "):
            text, i = joined(lines, i)
            command = COMMAND.search(text.strip())
            found = [tagged(text, command.group(1))] if command else []
        else:
            i += 1
            if line.startswith("|"):  # a command with arguments; `maxmoe plan` alone is prose
                found = [tagged(line, m.group(1)) for m in INLINE.finditer(line)
                         if re.search(r"[/.=_-]", m.group(1))]
        for example in found:
            example.where = f"{path.relative_to(ROOT)}:{start + 1}"
        out += found
    return out


EXAMPLES = [e for path in doc_files() for e in examples_in(path)]
RUNNABLE = [e for e in EXAMPLES if e.reason is None]


def test_the_reader_finds_code_lines_table_commands_and_tags(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("prose `maxmoe eval runs/x` is not read\n```bash\nmaxmoe eval runs/a\n"
                    "pip install -e . && maxmoe plan c.yaml \\\n  --cluster 8xh100  # not run: slow\n"
                    "```\n\n    $ maxmoe report runs/a\n\n| a | `maxmoe ckpt verify runs/a` |\n"
                    "| b | `maxmoe plan` |\n| c | `maxmoe eval runs/b` <!-- not run: why -->|\n")
    got = [(e.where, e.words, e.reason) for e in examples_in(page)]
    assert got == [("page.md:3", ["eval", "runs/a"], None),
                   ("page.md:4", ["plan", "c.yaml", "--cluster", "8xh100"], "slow"),
                   ("page.md:8", ["report", "runs/a"], None),
                   ("page.md:10", ["ckpt", "verify", "runs/a"], None),
                   ("page.md:12", ["eval", "runs/b"], "why")], got


def verbs() -> set[str]:
    """The verbs `maxmoe --help` lists."""
    sub = argparse.ArgumentParser().add_subparsers()
    for command in COMMANDS:
        command.add_parser(sub)
    return set(sub.choices)


def test_examples_are_found_and_every_verb_has_one_that_runs():
    assert len(EXAMPLES) >= 40, len(EXAMPLES)
    unknown = [e.where for e in EXAMPLES if not e.words or e.words[0] not in verbs()]
    assert not unknown, f"not a maxmoe verb: {unknown}"
    missing = verbs() - {e.words[0] for e in RUNNABLE}
    assert not missing, f"verbs with no runnable example in README.md or docs/: {missing}"


def test_the_readme_setup_commands_are_the_ones_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quick start.*?^```bash\n(.*?)^```", readme, re.M | re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands[0] == "pip install -e . && maxmoe train configs/tiny.yaml", commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, f".ci/run does not run the README's test command {commands[1]!r}"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The directory the examples run in (docs/index.md lists it): the repository's configs,
    docs and tools; runs/tiny, the quick start cut to 2 steps; hf_tiny, a random Hugging Face
    checkpoint of tiny_deepseek_v3; ids.npy, token ids [2, 16]."""
    from tools.make_random_hf_checkpoint import write_random_checkpoint

    here = tmp_path_factory.mktemp("doc_examples")
    for name in ("configs", "docs", "tools"):
        (here / name).symlink_to(ROOT / name)
    before = os.getcwd()
    os.chdir(here)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # the 200-step run's learning-rate schedule, so its step compiles as the examples'
            assert main(["train", "configs/tiny.yaml", "train.steps=2", "optimizer.decay_steps=180",
                         "checkpoint.every_steps=1", "train.eval_every_steps=2",
                         "train.eval_batches=1", "logging.progress_bar=false"]) == 0
        cfg, _ = load_config(["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"])
        write_random_checkpoint(cfg, here / "hf_tiny", 2**20)
        np.save("ids.npy", np.arange(32, dtype=np.int32).reshape(2, 16) % 100)
        yield here
    finally:
        os.chdir(before)


def run(words: list[str]) -> tuple[int, str]:
    """Exit code and the last stderr line of `maxmoe WORDS` in this process."""
    if words[0] == "train" and "--dry-run" not in words:
        words = [*words, "--dry-run"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(words)
        except SystemExit as stop:  # argparse's exits
            code = stop.code if isinstance(stop.code, int) else 2
    return code, (err.getvalue().strip().splitlines() or [""])[-1]


def test_a_line_that_does_not_run_is_caught(workspace):
    """The README's old eval line: tiny's expert axis is 2, so fsdp 8 leaves no devices."""
    code, last = run(["eval", "runs/tiny", "mesh.data=1", "mesh.fsdp=8"])
    assert code == 2 and "mesh" in last, (code, last)


def test_every_runnable_example_runs(workspace):
    """One test, in file order (README first: later lines may read what earlier ones wrote),
    so the compiles of one run are shared: repeats hit the process's XLA cache. A command met
    before is not run again."""
    failed, seen = [], set()
    for example in RUNNABLE:
        if tuple(example.words) in seen:
            continue
        seen.add(tuple(example.words))
        code, last = run(example.words)
        if code != 0:
            failed.append(f"{example.where}: maxmoe {shlex.join(example.words)} -> exit {code}: "
                          f"{last}")
    assert not failed, "examples that do not run (fix them, or tag them '# not run: WHY'):\n" + \
        "\n".join(failed)
