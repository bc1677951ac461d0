"""Near-duplicate detection for `maxmoe data prepare`: MinHash signatures and an LSH index.

A document's signature is the MinHash (datasketch) of its set of word n-grams ("shingles"),
computed in worker processes. The index lives in the main process and sees documents in a
fixed order: the first of a group of near-duplicates is kept, every later one whose
estimated Jaccard similarity to a kept document reaches the threshold is dropped.

The LSH bands are tuned for recall (a false negative costs a duplicate in the training set,
a false positive only a cheap check), and every LSH candidate is then checked against the
threshold with the full signature, so documents merely sharing a few bands are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

import numpy as np

from maxmoe.config import ConfigError

# MinHash scheme and seed are fixed so signatures stored by one run (for resumption) are
# comparable with those of the next, whatever datasketch's defaults become.
_SCHEME = "affine32"
_SEED = 1
# (false positive, false negative) weights for datasketch's band choice: at threshold 0.8
# and 128 permutations this picks 14 bands x 9 rows, which flags 87% of pairs at Jaccard
# 0.8 and 97% at 0.85 (0.5/0.5 would flag 40% and 69%).
_LSH_WEIGHTS = (0.1, 0.9)
_WORD = re.compile(r"\w+")
_MULTIPLIER = np.uint64(0x100000001B3)  # the 64-bit FNV prime: odd, well-mixed bits


@dataclasses.dataclass(frozen=True)
class DedupOptions:
    exact: bool = True  # drop documents whose normalised text was seen before
    near: bool = True  # drop near-duplicates found by MinHash LSH
    permutations: int = 128  # MinHash permutations (signature length)
    threshold: float = 0.8  # Jaccard similarity of shingle sets at which a document is a duplicate
    ngram: int = 5  # words per shingle

    def check(self) -> None:
        if self.permutations < 16:
            raise ConfigError(f"option --minhash-permutations {self.permutations}: too few for "
                              "a useful estimate; use 128 (or at least 16)")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"option --minhash-threshold {self.threshold}: must be in (0, 1); "
                              "use e.g. 0.8")
        if self.ngram < 1:
            raise ConfigError(f"option --minhash-ngram {self.ngram}: must be >= 1; use e.g. 5")


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """Sorted unique 32-bit hashes of the lower-cased word n-grams of `text`.

    Word hashes are cached and combined into n-gram hashes with numpy, several times faster
    than hashing every n-gram string in Python (the MinHash stage's main cost). Texts of at
    most `ngram` words are one shingle.
    """
    words = _WORD.findall(text.lower()) or [""]
    ids = np.fromiter((_word_hash(w) for w in words), np.uint64, len(words))
    count = max(len(words) - ngram + 1, 1)
    hashes = np.zeros(count, np.uint64)
    for offset in range(min(ngram, len(words))):
        # polynomial combination, wrapping modulo 2**64: order-sensitive, like the n-gram
        hashes = hashes * _MULTIPLIER + ids[offset:offset + count]
    return np.unique(((hashes >> np.uint64(32)) ^ hashes) & np.uint64(0xFFFFFFFF))


@functools.lru_cache(maxsize=1 << 20)
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


def _identity(value: int) -> int:
    return value


def signature(text: str, options: DedupOptions) -> np.ndarray:
    """[permutations] uint32 MinHash signature of the document's shingles."""
    from datasketch import MinHash  # imported on demand: datasketch pulls in scipy

    # the shingles are hashed already (shingle_hashes), so datasketch's hash is the identity
    minhash = MinHash(num_perm=options.permutations, seed=_SEED, scheme=_SCHEME,
                      hashfunc=_identity)
    minhash.update_batch(shingle_hashes(text, options.ngram).tolist())
    return np.asarray(minhash.hashvalues, dtype=np.uint32)


class NearDuplicateIndex:
    """Kept signatures in an LSH index; `is_duplicate` checks one document and remembers it."""

    def __init__(self, options: DedupOptions):
        from datasketch import LeanMinHash, MinHashLSH  # on demand: as MinHash above

        self._options = options
        self._lean = LeanMinHash
        self._lsh = MinHashLSH(threshold=options.threshold, num_perm=options.permutations,
                               weights=_LSH_WEIGHTS)
        # Signatures of kept documents, for checking LSH candidates (512 bytes a document
        # at 128 permutations, small next to the LSH tables themselves).
        self._signatures: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._signatures)

    def is_duplicate(self, candidate: np.ndarray) -> bool:
        """True when a kept document is at least `threshold` similar; else keeps `candidate`."""
        minhash = self._minhash(candidate)
        for key in self._lsh.query(minhash):
            if np.mean(self._signatures[key] == candidate) >= self._options.threshold:
                return True
        self._insert(candidate, minhash)
        return False

    def add(self, kept: np.ndarray) -> None:
        """Remembers a document kept by an earlier run (resumption), without checking it."""
        self._insert(kept, self._minhash(kept))

    def _minhash(self, values: np.ndarray):
        return self._lean(seed=_SEED, hashvalues=values, scheme=_SCHEME)

    def _insert(self, values: np.ndarray, minhash) -> None:
        self._lsh.insert(len(self._signatures), minhash, check_duplication=False)
        self._signatures.append(values)
