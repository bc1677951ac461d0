"""A refused `maxmoe train` writes nothing: every check runs before the first write.

Property: after each refusal (exit 2), the existing run directory holds exactly the same
files and folders with the same bytes (md5 of every file), and no new file or folder appears
beside it (a refused new run.dir is not created). Refusals covered: a model layout other than
the checkpoints' (docs/data.md's mistake: a new vocab size on an existing run), a
train.init_from of another layout, a data source that does not exist, a mesh that does not
divide the model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from maxmoe.cli import main
from tests.helpers import SMALL

STEPS = ["train.steps=1", "checkpoint.every_steps=1", "logging.progress_bar=false"]


def tree(root: Path) -> dict[str, str]:
    """Every path under root (files and folders), relative -> md5 of a file, 'dir' of a folder."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.md5(p.read_bytes())
            .hexdigest() for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(tmp folder, the train items) of a run trained for one step and saved."""
    root = tmp_path_factory.mktemp("refused")
    items = [*SMALL, *STEPS, "model.vocab_size=512", f"run.dir={root / 'run'}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAXMOE_CACHE", str(root / "cache"))
        assert main(["train", *items]) == 0
    return root, items


REFUSALS = {  # name: (extra train items, words of the one-line error); run.dir -> the run
    "model_layout": (["model.vocab_size=1024"], "saved for another model layout"),
    "init_from_layout": (["run.dir={root}/new", "train.init_from={root}/run",
                          "model.num_layers=4"], "train.init_from"),
    "missing_data": (["data.source={root}/no_such_corpus"], "data.source"),
    "mesh": (["mesh.expert=3"], "mesh.expert"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refused_start_leaves_the_run_dir_byte_identical(name, trained, monkeypatch, capsys):
    root, items = trained
    monkeypatch.setenv("MAXMOE_CACHE", str(root / "cache"))
    extra, words = REFUSALS[name]
    extra = [e.format(root=root) for e in extra]
    before = tree(root / "run")
    beside = sorted(p.name for p in root.iterdir())
    assert "config.yaml" in before and "tokenizer/tokenizer.model" in before
    assert any(k.startswith("checkpoints/1/state/") for k in before)
    capsys.readouterr()
    assert main(["train", *items, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("maxmoe: error:") and words in err[-1], err[-5:]
    assert tree(root / "run") == before
    assert sorted(p.name for p in root.iterdir()) == beside  # nothing new beside it
