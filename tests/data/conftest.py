"""Shared fixtures of the data tests: a small tokenizer and synthetic documents."""

import random

import numpy as np
import pytest

from maxmoe.data import shards
from maxmoe.data.tokenizer import MODEL_FILE, Tokenizer, sentence_chunks, train_model

ENGLISH = ("the of and to in is that it was for on are as with his they at be this have from "
           "or one had by word but not what all were we when your can said there use an each "
           "which she do how their if will up other about out many then them these so some her "
           "would make like him into time has look two more write go see number no way could "
           "people my than first water been call who its now find long down day did get come "
           "made may part").split()
GERMAN = ("der die und in den von zu das mit sich des auf für ist im dem nicht ein eine als auch "
          "es an werden aus er hat dass sie nach wird bei einer um am sind noch wie einem über "
          "einen so zum war haben nur oder aber vor zur bis mehr durch man sein wurde sei").split()


def english(rng: random.Random, words: int) -> str:
    """Word salad of common English words (py3langid calls it English every time)."""
    return " ".join(rng.choice(ENGLISH) for _ in range(words))


def german(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(GERMAN) for _ in range(words))


def distinct_document(rng: random.Random, words: int) -> str:
    """English-looking text over a large vocabulary: two such documents share few 5-grams."""
    vocabulary = ENGLISH + [f"{w}{i}" for w in ENGLISH[:40] for i in range(50)]
    return " ".join(rng.choice(vocabulary) for _ in range(words))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    rng = random.Random(0)
    text = "\n".join(english(rng, 40) + " " + german(rng, 20) + f" {i}" for i in range(400))
    directory = tmp_path_factory.mktemp("tokenizer")
    model = train_model(sentence_chunks(text), 384, problem_key="test", sample="test text")
    (directory / MODEL_FILE).write_bytes(model)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return Tokenizer(tokenizer_dir / MODEL_FILE)


def read_split(directory, split: str, tokenizer) -> list[str]:
    """Decoded documents of one split of a prepared dataset, in shard order."""
    from array_record.python.array_record_module import ArrayRecordReader

    manifest = shards.load_manifest(str(directory))
    texts = []
    for path in shards.split_files(str(directory), manifest, split):
        reader = ArrayRecordReader(path)
        records = reader.read_all()
        reader.close()
        texts.extend(tokenizer.decode(np.frombuffer(r, manifest["token_dtype"])) for r in records)
    return texts
