"""MinHash near-dedup parameters for datatrove's MinHash stages, and an offline word tokenizer.

Datatrove's stages (signature -> buckets -> cluster -> filter) flag two documents as
near-duplicates when all `hashes_per_bucket` MinHash values of any one of `num_buckets`
buckets agree. For shingle sets of Jaccard similarity s that happens with probability

    P(s) = 1 - (1 - s**r) ** b        (r = hashes_per_bucket, b = num_buckets)

an S-curve whose midpoint is about (1/b) ** (1/r). There is no verification step after the
buckets, so P(s) is both the recall at s and the false-positive rate at s.

Why these values (measured on maxmoe/data/synthetic_dups.py's corpus; figures in
docs/performance/data.md, "Near-duplicate detection"): planted near-duplicates edit 1-5% of
words, hard negatives share boilerplate at Jaccard 0.3-0.7, and the targets are recall >= 0.98
and <= 1% false positives.
Editing a fraction p of words keeps about (1-p)**n of the n-gram shingles, so Jaccard is
q / (2 - q) with q = (1-p)**n: at p = 5% that is 0.63 for 5-grams (FineWeb's choice), 0.75 for
3-grams, 0.82 for 2-grams and 0.90 for single words. No S-curve of a few hundred hashes
separates 0.82 from 0.7 (at 504 hashes the best one with <= 0.5% mean false positives over
Jaccard 0.3-0.7 catches 57% at 0.82); single words at 0.90 can be separated, with 28 x 18.
"""

from __future__ import annotations

import dataclasses
import re

from datatrove.pipeline.dedup.minhash import MinhashConfig
from datatrove.utils.hashing import HashConfig
from datatrove.utils.text import TextNormConfig
from datatrove.utils.word_tokenizers import WordTokenizer


@dataclasses.dataclass(frozen=True)
class MinhashParams:
    # words per shingle: 1 puts 5%-edited copies at Jaccard >= 0.90, clear of hard negatives
    # at <= 0.7 (5-grams, FineWeb's choice, put them at 0.63; see the module docstring)
    ngram: int = 1
    # buckets (LSH bands) b: with r = 18, P(0.90) = 0.989 and P(0.70) = 0.045, a mean of 0.42%
    # over Jaccard 0.3-0.7: the best b x r within 512 hashes at <= 0.5% mean false positives
    # (tools/dedup_figures.py scan); 22 x 17 = 374 hashes gives P(0.90) = 0.982, no margin
    num_buckets: int = 28
    # hashes per bucket (LSH rows) r: sets the S-curve's steepness, midpoint (1/28)**(1/18) = 0.83
    hashes_per_bucket: int = 18
    # bits per stored hash: 32 nearly halves FineWeb's 64-bit signature files (2 KB a document);
    # a chance 32-bit collision of all 18 hashes of a bucket is ~2**-576, never seen
    precision: int = 32
    # shingle hash: hashlib's sha1 needs no extra package (datatrove's default wants xxhash)
    hash_fc: str = "sha1"
    # permutation seed: the same on every task and every run, so signatures stay comparable
    seed: int = 1

    @property
    def num_hashes(self) -> int:
        return self.num_buckets * self.hashes_per_bucket

    @property
    def threshold(self) -> float:
        """Jaccard similarity at which a pair is flagged with probability ~1/2: (1/b)**(1/r)."""
        return (1.0 / self.num_buckets) ** (1.0 / self.hashes_per_bucket)

    def detection_probability(self, similarity: float) -> float:
        """P(pair at shingle Jaccard `similarity` shares a bucket) = 1 - (1 - s**r)**b."""
        return 1.0 - (1.0 - similarity ** self.hashes_per_bucket) ** self.num_buckets


def minhash_config(params: MinhashParams | None = None) -> MinhashConfig:
    """Datatrove's MinhashConfig for `params` (defaults: MinhashParams()).

    Pass the same config to all four stages; the text normalisation is datatrove's default
    (lower case, no punctuation, digits -> 0, accents stripped), as FineWeb used.
    """
    params = params or MinhashParams()
    return MinhashConfig(n_grams=params.ngram, num_buckets=params.num_buckets,
                         hashes_per_bucket=params.hashes_per_bucket, seed=params.seed,
                         norm_config=TextNormConfig(),
                         hash_config=HashConfig(precision=params.precision,
                                                hash_fc=params.hash_fc))


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class WhitespaceWordTokenizer(WordTokenizer):
    """Splits on whitespace: needs no NLTK/spaCy data, so the stages run offline.

    Datatrove's MinHash signature stage tokenizes text that `simplify_text` has already
    lower-cased, stripped of punctuation and whitespace-normalised, so splitting on spaces gives
    the same words NLTK's English tokenizer would. Pass an instance as `language=` to
    MinhashDedupSignature (datatrove's load_word_tokenizer accepts a WordTokenizer).
    """

    def __init__(self):
        super().__init__("en")

    def word_tokenize(self, text: str) -> list[str]:
        return text.split()

    def sent_tokenize(self, text: str) -> list[str]:
        return [s for s in (part.strip() for part in _SENTENCE_END.split(text)) if s]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        spans, start = [], 0
        for sentence in self.sent_tokenize(text):
            begin = text.index(sentence, start)
            start = begin + len(sentence)
            spans.append((begin, start))
        return spans


def word_tokenizer() -> WordTokenizer:
    """The word tokenizer to give MinhashDedupSignature as `language=` (offline, picklable)."""
    return WhitespaceWordTokenizer()
