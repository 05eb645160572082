"""The benchmark checkpoint writer: its directory loads in pdserve with the asked shape and
gives the same logits as transformers on it."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.bench.make_checkpoint_args import add_arguments, main_from_args
from pdserve.config import ModelConfig
from pdserve.kv.cache import KVCache
from pdserve.model.attention import SeqSlice, build_attention_metadata
from pdserve.model.loader import load_model


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "qwen3"
    argv = ["--out", str(out), "--layers", "2", "--hidden", "64", "--intermediate", "96"]
    argv += ["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab-size", "300"]
    assert main_from_args(_args(*argv, "--dtype", "float32", "--max-positions", "512")) == 0
    return out


def test_loads_with_the_asked_shape(ckpt):
    loaded = load_model(ModelConfig(model=str(ckpt), dtype="auto"))
    s = loaded.spec
    assert (s.num_layers, s.hidden_size, s.intermediate_size) == (2, 64, 96)
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == (4, 2, 16, 300)
    assert s.tie_word_embeddings and s.qk_norm and loaded.dtype == torch.float32
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello")) == "hello"


def test_logits_match_transformers(ckpt):
    from transformers import AutoModelForCausalLM

    loaded = load_model(ModelConfig(model=str(ckpt), dtype="float32"))
    ids = [5, 77, 299, 12, 260, 3, 9]
    kv = KVCache.allocate(loaded.spec, 4, 16, torch.float32, "cpu")
    meta = build_attention_metadata([SeqSlice([1], 0, len(ids))], 16, "cpu")
    hidden = loaded.model(torch.tensor(ids), meta.positions, meta, kv)
    ours = loaded.model.compute_logits(hidden)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_refuses_to_overwrite(ckpt, capsys):
    assert main_from_args(_args("--out", str(ckpt))) == 1
    assert "exists" in capsys.readouterr().out
