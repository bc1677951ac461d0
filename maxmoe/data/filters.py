"""Per-document cleaning for `maxmoe data prepare`: normalisation, length and language filters.

Each function looks at one document and nothing else, so the cleaning stage runs in worker
processes with no shared state. A filter returns the name of the reason it drops a document
(counted in the manifest under `dropped`), or None to keep it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import unicodedata

from maxmoe.config import ConfigError

NORMALIZATION_FORMS = ("none", "NFC", "NFKC", "NFD", "NFKD")


@dataclasses.dataclass(frozen=True)
class FilterOptions:
    normalization: str = "NFC"  # Unicode normal form applied before anything else; none = off
    min_characters: int = 0  # drop shorter documents (0 = no limit)
    max_characters: int = 0  # drop longer documents (0 = no limit)
    min_tokens: int = 0  # drop documents with fewer tokens (0 = no limit)
    max_tokens: int = 0  # drop documents with more tokens (0 = no limit)
    languages: tuple[str, ...] = ()  # ISO 639-1 codes to keep, e.g. ('en', 'de'); () = off
    min_language_confidence: float = 0.0  # also drop documents detected below this probability
    language_sample_characters: int = 4000  # detect on the first N characters (speed)

    def check(self) -> None:
        """Raises ConfigError (naming the option) for impossible settings."""
        if self.normalization not in NORMALIZATION_FORMS:
            raise ConfigError(f"option --normalization {self.normalization!r}: unknown form; "
                              f"use one of {', '.join(NORMALIZATION_FORMS)}")
        for name in ("min_characters", "max_characters", "min_tokens", "max_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"option --{name.replace('_', '-')} {getattr(self, name)}: "
                                  "must be >= 0; use 0 for no limit")
        for low, high in (("min_characters", "max_characters"), ("min_tokens", "max_tokens")):
            if getattr(self, high) and getattr(self, low) > getattr(self, high):
                raise ConfigError(f"option --{high.replace('_', '-')} {getattr(self, high)}: "
                                  f"below --{low.replace('_', '-')} {getattr(self, low)}; "
                                  "raise it or lower the minimum")
        if not 0.0 <= self.min_language_confidence <= 1.0:
            raise ConfigError(f"option --min-language-confidence {self.min_language_confidence}:"
                              " must be in [0, 1]; use e.g. 0.5")
        if self.languages:
            unknown = sorted(set(self.languages) - set(_language_identifier().labels))
            if unknown:
                raise ConfigError(f"option --languages: unknown code(s) {', '.join(unknown)}; "
                                  "use ISO 639-1 codes such as en, de, fr, zh")


def normalize(text: str, options: FilterOptions) -> str:
    if options.normalization == "none":
        return text
    # NFC first: it is cheap on text that is already composed, which is almost all text.
    return unicodedata.normalize(options.normalization, text)


def character_filter(text: str, options: FilterOptions) -> str | None:
    if not text.strip():
        return "empty"
    if options.min_characters and len(text) < options.min_characters:
        return "too_few_characters"
    if options.max_characters and len(text) > options.max_characters:
        return "too_many_characters"
    return None


def token_filter(token_count: int, options: FilterOptions) -> str | None:
    if options.min_tokens and token_count < options.min_tokens:
        return "too_few_tokens"
    if options.max_tokens and token_count > options.max_tokens:
        return "too_many_tokens"
    return None


def language_filter(text: str, options: FilterOptions) -> str | None:
    if not options.languages:
        return None
    language, confidence = detect_language(text[:options.language_sample_characters])
    if language not in options.languages or confidence < options.min_language_confidence:
        return "language"
    return None


def detect_language(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, probability) from py3langid, whose model ships inside the wheel."""
    language, probability = _language_identifier().classify(text)
    return language, float(probability)


_IDENTIFIER = None


def _language_identifier():
    # Loaded once per process on first use (about 0.3 s); normalised probabilities make
    # --min-language-confidence a number users can reason about.
    global _IDENTIFIER
    if _IDENTIFIER is None:
        from py3langid.langid import (  # on demand: 0.3 s to import, language filter only
            MODEL_FILE,
            LanguageIdentifier,
        )

        _IDENTIFIER = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _IDENTIFIER


def content_hash(text: str) -> bytes:
    """16-byte digest of the (normalised) text: equal texts, equal hashes (exact dedup)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
