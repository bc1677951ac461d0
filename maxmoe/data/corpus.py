"""Where the training text comes from: listing, reading and splitting documents.

A document is one file. `data.source` is either `stdlib` (the Python sources of the running
interpreter, present on every machine, so the tiny config trains without downloads) or a
glob of plain text files. Listing is cheap and never reads file contents; a file that turns
out to be unreadable is skipped when it is read, so listing stays fast on large corpora.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig

from maxmoe.config import fail

STDLIB = "stdlib"

# Third-party packages live inside the stdlib tree but are not the standard library, and
# their contents differ between machines (which would make the corpus machine-dependent).
_SKIPPED_DIRECTORIES = {"site-packages", "dist-packages", "__pycache__"}


def list_documents(source: str) -> list[str]:
    """Sorted absolute paths of the documents of `source` ('stdlib' or a glob of text files)."""
    if source == STDLIB:
        return _stdlib_sources()
    pattern = os.path.expanduser(source)
    matches = glob.glob(pattern, recursive=True)
    paths = sorted({os.path.abspath(m) for m in matches if os.path.isfile(m)})
    if not paths:
        fail("data.source", source, None, "the glob matches no files",
             "point it at existing text files (e.g. 'corpus/**/*.txt', quoted) or use 'stdlib'")
    return paths


def _stdlib_sources() -> list[str]:
    root = os.path.abspath(sysconfig.get_paths()["stdlib"])
    paths = []
    # os.walk does not follow directory symlinks, so a link loop cannot hang the listing.
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_DIRECTORIES]
        paths.extend(os.path.join(directory, f) for f in files if f.endswith(".py"))
    if not paths:
        fail("data.source", STDLIB, None, f"no .py files under {root} (a stripped Python "
             "install?)", "set data.source to a glob of text files instead")
    return sorted(paths)


def read_document(path: str) -> str | None:
    """The text of `path`, or None when it cannot be read or is not valid UTF-8."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        # The stdlib ships deliberately mis-encoded test files; one bad file must not
        # stop training, and skipping it here keeps listing free of reads.
        return None


def document_keys(paths: list[str]) -> list[str]:
    """Machine-independent names of `paths`: each path relative to their common folder.

    Hashing these instead of absolute paths gives the same split and sample wherever the
    corpus lives (e.g. /usr/lib/python3.11 vs a pyenv install).
    """
    if not paths:
        return []
    if len(paths) == 1:
        return [os.path.basename(paths[0])]
    root = os.path.commonpath(paths)
    return [os.path.relpath(p, root) for p in paths]


def unit_hash(key: str, seed: int) -> float:
    """A deterministic pseudo-random number in [0, 1) for (key, seed)."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_documents(paths: list[str], validation_fraction: float,
                    seed: int) -> tuple[list[str], list[str]]:
    """Splits documents into (train, validation), both sorted, by a per-document hash.

    Each document's side depends only on its own name and the seed, so adding or removing a
    file never moves another file across the split (no leakage between runs on a growing
    corpus).
    """
    if not 0.0 <= validation_fraction < 1.0:
        fail("data.validation_fraction", validation_fraction, None, "must be in [0, 1)",
             "use e.g. 0.02")
    scores = {p: unit_hash(k, seed) for p, k in zip(paths, document_keys(paths), strict=True)}
    validation = {p for p, s in scores.items() if s < validation_fraction}
    if validation_fraction > 0 and not validation and len(paths) >= 2:
        # A small corpus can miss the fraction by chance; evaluation still needs a document.
        validation = {min(scores, key=scores.get)}
    train = sorted(p for p in paths if p not in validation)
    if not train:
        fail("data.validation_fraction", validation_fraction, None,
             f"leaves no training documents out of {len(paths)}", "lower it")
    return train, sorted(validation)
