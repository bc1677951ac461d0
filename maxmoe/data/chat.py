"""Conversations -> token ids and the mask of the tokens a fine-tuning loss trains on.

With a chat template (tokenizer_config.json's jinja `chat_template`), a conversation is
rendered as transformers renders it: a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, the loopcontrols extension, a `tojson` filter and `raise_exception` /
`strftime_now` globals; the context holds `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` (and `pad_token`, `unk_token`). The trained spans are found by rendering prefix by
prefix: before a trained message the conversation so far with the generation prompt, after it
the conversation including it; the text between (the answer and the template's end-of-turn
tokens) is trained, the rest is not. Each new piece of text is tokenised on its own, so the
mask lines up with the ids exactly. A template that does not render a conversation as an
extension of its prefixes cannot be split this way and is refused.

Without a chat template (SentencePiece models, or a tokenizer.json without one) the default
format is, per message:

    untrained: "<|ROLE|>\\n" + content + "\\n"           (system, user, ... any other role)
    assistant: "<|assistant|>\\n" (untrained) + content + EOS id (trained)

and the generation prompt is "<|assistant|>\\n". The EOS is the id itself, not its text.
"""

from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

from maxmoe.data.tokenizer import Tokenizer

DEFAULT_GENERATION_PROMPT = "<|assistant|>\n"


class TemplateError(ValueError):
    """The chat template cannot render, or cannot be split into trained spans of, a record."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """The jinja template in transformers' environment (module docstring)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def render_template(tokenizer: Tokenizer, messages: list[dict],
                    add_generation_prompt: bool) -> str:
    """The text tokenizer.chat_template renders for `messages`; TemplateError if it fails."""
    specials = getattr(tokenizer, "special_tokens", {}) or {}
    try:
        return compile_template(tokenizer.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{key: specials.get(key) or "" for key in ("bos_token", "eos_token", "pad_token",
                                                        "unk_token")})
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"the chat template fails on it ({e})") from None


def conversation_ids(tokenizer: Tokenizer, messages: list[dict],
                     trained: list[bool]) -> tuple[list[int], list[bool]]:
    """(ids, is_trained per id) of a conversation; `trained[i]` says whether message i is an
    answer the loss trains on. The chat template's rendering, else the default format."""
    if tokenizer.chat_template:
        return _templated_ids(tokenizer, messages, trained)
    return _default_ids(tokenizer, messages, trained)


def _templated_ids(tokenizer: Tokenizer, messages: list[dict],
                   trained: list[bool]) -> tuple[list[int], list[bool]]:
    ids: list[int] = []
    flags: list[bool] = []
    done = ""  # the text tokenised so far: every later rendering must extend it

    def extend(text: str, flag: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise TemplateError("the chat template does not render this conversation as an "
                                "extension of its prefixes, so the trained tokens cannot be "
                                "marked")
        piece = tokenizer.encode(text[len(done):]) if len(text) > len(done) else []
        ids.extend(piece)
        flags.extend([flag] * len(piece))
        done = text

    for index, flag in enumerate(trained):
        if flag:
            extend(render_template(tokenizer, messages[:index], True), False)
        extend(render_template(tokenizer, messages[:index + 1], False), flag)
    return ids, flags


def _default_ids(tokenizer: Tokenizer, messages: list[dict],
                 trained: list[bool]) -> tuple[list[int], list[bool]]:
    if tokenizer.eos_id is None:
        raise TemplateError("the tokenizer has neither a chat template nor an EOS token, which "
                            "the default format ends every answer with")
    ids: list[int] = []
    flags: list[bool] = []
    for message, flag in zip(messages, trained, strict=True):
        if message["role"] == "assistant":
            head = tokenizer.encode(DEFAULT_GENERATION_PROMPT)
            body = [*tokenizer.encode(message["content"]), tokenizer.eos_id]
        else:
            head, body = tokenizer.encode(f"<|{message['role']}|>\n{message['content']}\n"), []
        ids.extend(head)
        flags.extend([False] * len(head))
        ids.extend(body)
        flags.extend([flag] * len(body))
    return ids, flags
