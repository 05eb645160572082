"""Tokenizer: a Hugging Face `tokenizer.json` (run by the `tokenizers` library) plus the
settings around it (`tokenizer_config.json`, `generation_config.json`, `config.json`) and the
chat template (rendered by jinja2 in an immutable sandbox, as transformers does).

BOS rule: `encode(text)` adds a BOS token only when the checkpoint asks for one:
`add_bos_token: true` in tokenizer_config.json, or, when that key is absent, whatever the
tokenizer.json post-processor adds (Llama 3 adds `<|begin_of_text|>`, Qwen adds nothing).
A prompt rendered by `apply_chat_template` already holds its special tokens: encode it with
`add_special_tokens=False`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Immutable after construction; safe to share between threads for encode/decode."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: Mapping[str, Any],
        extra_eos_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._special = {k: _token_text(config.get(k)) for k in _SPECIAL_KEYS}
        self._add_bos = config.get("add_bos_token")
        self.bos_token_id = self._id_of(self._special["bos_token"])
        eos = {self._id_of(self._special["eos_token"]), *extra_eos_ids}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in eos if i is not None)
        self.chat_template = chat_template
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (needs tokenizer.json)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found (only fast tokenizers are supported)")
        config = _read_json(path / "tokenizer_config.json")
        extra_eos = [
            *_ids(_read_json(path / "generation_config.json").get("eos_token_id")),
            *_ids(_read_json(path / "config.json").get("eos_token_id")),
        ]
        template = _chat_template(path, config)
        return cls(tokenizers.Tokenizer.from_file(str(file)), config, extra_eos, template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False` never adds BOS (see module doc)."""
        if not add_special_tokens:
            return self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos is None:
            return self._backend.encode(text, add_special_tokens=True).ids
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh per-request streaming detokenizer (owned by one request, one thread)."""
        return IncrementalDecoder(self._backend, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the checkpoint's chat template.

        Extra keyword arguments (e.g. `tools`, `enable_thinking`) reach the template as
        variables. Raises ValueError if the checkpoint has no template or the template
        rejects the conversation.
        """
        if self._template is None:
            raise ValueError("this model has no chat_template; use a plain completion prompt")
        variables = {k: v for k, v in self._special.items() if v is not None}
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8.

    Wraps `tokenizers.decoders.DecodeStream`; `step(id)` returns the new text ("" while a
    multi-byte character is still incomplete).
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def _compile(template: str) -> jinja2.Template:
    try:
        return _jinja_env().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc}") from exc


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (same options and globals)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja beside the tokenizer wins (newer transformers save it there)."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _token_text(value: Any) -> str | None:
    """Special tokens are stored as a string or as a serialised AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
