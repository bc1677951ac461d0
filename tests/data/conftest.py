"""Shared fixtures of the data tests: a small tokenizer and synthetic documents."""

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizerModel, decoders, models, pre_tokenizers, trainers

from maxmoe.data import shards
from maxmoe.data.tokenizer import (
    MODEL_FILE,
    SentencePieceTokenizer,
    sentence_chunks,
    train_model,
)

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
    """English-looking text over a large vocabulary: two such documents share few words.
    The variants are letters, not digits: MinHash's text normalisation maps digits to 0."""
    return " ".join(rng.choice(_DISTINCT_WORDS) for _ in range(words))


_DISTINCT_WORDS = ENGLISH + [f"{w}{a}{b}" for w in ENGLISH[:40] for a in "bdfgkmpstvz"
                             for b in "aeiou"]


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
    return SentencePieceTokenizer(tokenizer_dir / MODEL_FILE)


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


# A ChatML-style template, written the way released models write theirs (jinja, transformers'
# context: messages, add_generation_prompt, bos_token, eos_token).
CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
HF_SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def write_hf_tokenizer(directory, vocab_size: int = 400, chat_template: str | None = None,
                       config: dict | None = None):
    """Trains a byte-level BPE tokenizer.json with the `tokenizers` library on synthetic text
    and writes it with a tokenizer_config.json (special tokens as AddedToken dicts and
    strings, as released configs mix them) into `directory`."""
    rng = random.Random(1)
    lines = [english(rng, 30) + " " + german(rng, 10) + f" {i}" for i in range(300)]
    model = HFTokenizerModel(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=HF_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    model.save(str(directory / "tokenizer.json"))
    settings = config if config is not None else {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": None,
    }
    if chat_template is not None:
        settings = {**settings, "chat_template": chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory):
    """A small Hugging Face tokenizer folder with a ChatML chat template."""
    return write_hf_tokenizer(tmp_path_factory.mktemp("hf_tokenizer"),
                              chat_template=CHATML_TEMPLATE)
