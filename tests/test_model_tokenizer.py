"""Tokenizer settings around tokenizer.json: BOS rule, EOS sources, chat template handling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
from tokenizers import processors

from pdserve.model.builtin import ensure_builtin
from pdserve.model.tokenizer import Tokenizer

EOT, IM_START, IM_END = 256, 257, 258  # ids of the built-in tokenizer's special tokens


@pytest.fixture(scope="module")
def builtin_dir(tmp_path_factory) -> Path:
    return ensure_builtin("tiny", tmp_path_factory.mktemp("cache"))


def make_dir(tmp_path: Path, builtin_dir: Path, tok_config: dict, **files: dict) -> Path:
    """A directory with the built-in tokenizer.json and the given JSON side files."""
    shutil.copy(builtin_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    return tmp_path


def test_bos_added_only_when_configured(tmp_path, builtin_dir):
    on = Tokenizer.from_dir(
        make_dir(tmp_path, builtin_dir, {"add_bos_token": True, "bos_token": "<|endoftext|>"})
    )
    assert on.bos_token_id == EOT
    assert on.encode("hi") == [EOT, ord("h"), ord("i")]
    assert on.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    off = Tokenizer.from_dir(make_dir(tmp_path, builtin_dir, {"bos_token": "<|endoftext|>"}))
    assert off.encode("hi") == [ord("h"), ord("i")]


def test_bos_from_post_processor_when_config_is_silent(tmp_path, builtin_dir):
    """Llama 3 style: tokenizer.json's post-processor adds BOS, the config says nothing."""
    backend = tokenizers.Tokenizer.from_file(str(builtin_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", EOT)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hi") == [EOT, ord("h"), ord("i")]
    assert tok.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]


def test_eos_ids_union_of_three_sources(tmp_path, builtin_dir):
    path = make_dir(
        tmp_path,
        builtin_dir,
        {"eos_token": {"content": "<|im_end|>", "special": True}},
        generation_config={"eos_token_id": [EOT, 42]},
        config={"eos_token_id": 7},
    )
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == {IM_END, EOT, 42, 7}
    assert tok.eos_token == "<|im_end|>"


def test_no_template_is_a_clear_error(tmp_path, builtin_dir):
    tok = Tokenizer.from_dir(make_dir(tmp_path, builtin_dir, {}))
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_globals_and_raise_exception(tmp_path, builtin_dir):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}{{ extra }}"
    )
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}
    tok = Tokenizer.from_dir(make_dir(tmp_path, builtin_dir, cfg))
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], extra="!")
    assert out == '<|im_start|>[{"role": "user", "content": "é"}]<|im_end|>!'
    with pytest.raises(ValueError, match="user first"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_sandbox_blocks_mutation(tmp_path, builtin_dir):
    cfg = {"chat_template": "{{ messages.append(1) }}"}
    tok = Tokenizer.from_dir(make_dir(tmp_path, builtin_dir, cfg))
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_file_wins_and_named_templates(tmp_path, builtin_dir):
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    path = make_dir(tmp_path, builtin_dir, {"chat_template": named})
    assert Tokenizer.from_dir(path).apply_chat_template([]) == "D"
    (path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(path).apply_chat_template([]) == "J"


def test_broken_template_fails_at_load(tmp_path, builtin_dir):
    path = make_dir(tmp_path, builtin_dir, {"chat_template": "{% for %}"})
    with pytest.raises(ValueError, match="does not parse"):
        Tokenizer.from_dir(path)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
