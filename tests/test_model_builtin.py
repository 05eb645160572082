"""Built-in models: deterministic bytes, atomic generation, loadable, usable tokenizer."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import ModelConfig
from pdserve.model import builtin
from pdserve.model.builtin import RECIPES, SPECIAL_TOKENS, ensure_builtin
from pdserve.model.loader import load_model
from pdserve.model.tokenizer import Tokenizer


def digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return ensure_builtin("tiny", tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_generation_is_deterministic(name, tmp_path):
    a = ensure_builtin(name, tmp_path / "a")
    b = ensure_builtin(name, tmp_path / "b")
    assert a.name == b.name and name in a.name
    assert digest(a) == digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(digest(a))


def test_generation_is_deterministic_across_processes(tiny_dir, tmp_path):
    code = (
        "import sys; from pathlib import Path; from pdserve.model.builtin import ensure_builtin;"
        "print(ensure_builtin('tiny', Path(sys.argv[1])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True
    )
    other = Path(out.stdout.strip())
    assert other.name == tiny_dir.name
    assert digest(other) == digest(tiny_dir)


def test_existing_model_is_reused(tiny_dir):
    before = tiny_dir.stat().st_mtime_ns
    assert ensure_builtin("tiny", tiny_dir.parent) == tiny_dir
    assert tiny_dir.stat().st_mtime_ns == before


def test_losing_the_rename_race_uses_the_winner(tmp_path, monkeypatch):
    """Another process finishes first while we are still writing: we keep its copy."""
    real_write = builtin.write_model_dir
    winner: list[tuple[Path, int]] = []

    def slow_write(recipe, path):
        monkeypatch.setattr(builtin, "write_model_dir", real_write)
        other = ensure_builtin("tiny", tmp_path)  # the "other process" wins meanwhile
        winner.append((other, (other / "model.safetensors").stat().st_ino))
        real_write(recipe, path)

    monkeypatch.setattr(builtin, "write_model_dir", slow_write)
    result = ensure_builtin("tiny", tmp_path)
    assert [result] == [w for w, _ in winner]
    assert (result / "model.safetensors").stat().st_ino == winner[0][1]  # not replaced
    assert [p.name for p in tmp_path.iterdir()] == [result.name]  # no temp dir left


def test_recipe_change_gets_a_new_directory():
    tiny = RECIPES["tiny"]
    changed = builtin.BuiltinRecipe(**{**tiny.__dict__, "seed": tiny.seed + 1})
    assert builtin.recipe_hash(changed) != builtin.recipe_hash(tiny)


def test_unknown_builtin_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="tiny"):
        ensure_builtin("huge", tmp_path)


def test_loads_through_load_model(tiny_dir):
    lm = load_model(ModelConfig(model="builtin:tiny", cache_dir=tiny_dir.parent))
    assert lm.path == tiny_dir and lm.name == "builtin:tiny"
    assert lm.spec.family == "qwen3" and lm.spec.tie_word_embeddings
    assert lm.spec.vocab_size == lm.tokenizer.vocab_size == 256 + len(SPECIAL_TOKENS)


@settings(max_examples=60, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_utf8(tiny_dir, text):
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # byte-level, no merges, no BOS
    assert tok.decode(ids) == text


def test_special_tokens_and_eos(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert tok.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert tok.encode("a<|im_end|>") == [ord("a"), ids["<|im_end|>"]]
    assert tok.decode([ord("a"), ids["<|im_end|>"]]) == "a"
    assert tok.decode([ids["<|im_end|>"]], skip_special_tokens=False) == "<|im_end|>"


def test_chat_template_renders_chatml(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}],
        },
    ]
    rendered = tok.apply_chat_template(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi !<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_chat_template_agrees_with_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tok = Tokenizer.from_dir(tiny_dir)
    messages = [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "ok"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert tok.encode(expected, add_special_tokens=False) == hf.encode(
        expected, add_special_tokens=False
    )


def test_incremental_decoder_holds_back_partial_utf8(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir)
    text = "a✓b"
    stream = tok.incremental_decoder()
    pieces = [stream.step(i) for i in tok.encode(text)]
    assert pieces == ["a", "", "", "✓", "b"]
