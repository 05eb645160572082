"""The paged Decoder matches transformers on the same random weights (logits and greedy tokens).

Each case builds a tiny random transformers model, re-initialises its weights at a realistic
scale (transformers' 0.02 init gives near-equal logits whose argmax float noise decides),
saves it with `save_pretrained` and loads it back through `load_model`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.kv.cache import KVCache
from pdserve.model.attention import SeqSlice, build_attention_metadata
from pdserve.model.builtin import ensure_builtin
from pdserve.model.loader import LoadedModel, load_model

transformers = pytest.importorskip("transformers")

BLOCK = 8
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so head_dim 16 spans all three bands
}
CASES = {
    "qwen3-tied": ("Qwen3", {"tie_word_embeddings": True}),
    "qwen3-untied": ("Qwen3", {"tie_word_embeddings": False}),
    "llama3-rope-bias": (
        "Llama",
        {"rope_scaling": LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True},
    ),
    "llama-linear-tied": (
        "Llama",
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True},
    ),
    "qwen2-tied": ("Qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("Qwen2", {"tie_word_embeddings": False}),
}


def make_hf_model(family: str, extra: dict, seed: int = 0):
    """A random transformers model with weights at a scale that separates the logits."""
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    config = config_cls(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    model = model_cls(config).eval()
    randomize(model, seed)
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        elif "embed_tokens" in name or name.startswith("lm_head"):
            p.copy_(noise * 4 / hidden**0.5)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)


def save_hf_dir(model, path: Path, tokenizer_from: Path, **save_kwargs) -> Path:
    """`save_pretrained` plus the built-in byte-level tokenizer files (the loader wants one)."""
    model.save_pretrained(path, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return ensure_builtin("tiny", tmp_path_factory.mktemp("builtin"))


def load(path: Path) -> LoadedModel:
    return load_model(ModelConfig(model=str(path), dtype="float32"))


def prefill_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position, through the paged path with a fresh cache."""
    kv = KVCache.allocate(lm.spec, 64, BLOCK, lm.dtype, "cpu")
    table = list(range(63, 63 - len(ids) // BLOCK - 1, -1))  # reversed: not the identity map
    meta = build_attention_metadata([SeqSlice(table, 0, len(ids))], BLOCK, "cpu")
    hidden = lm.model(torch.tensor(ids), meta.positions, meta, kv)
    return lm.model.compute_logits(hidden)


def greedy_paged(lm: LoadedModel, ids: list[int], n: int) -> list[int]:
    """Prefill, then n - 1 single-token decode steps, all through the paged path."""
    kv = KVCache.allocate(lm.spec, 64, BLOCK, lm.dtype, "cpu")
    table = list(range(1, 64, 2))
    tokens, fed = list(ids), 0
    while len(tokens) < len(ids) + n:
        meta = build_attention_metadata([SeqSlice(table, fed, len(tokens) - fed)], BLOCK, "cpu")
        hidden = lm.model(torch.tensor(tokens[fed:]), meta.positions, meta, kv)
        logits = lm.model.compute_logits(hidden[meta.logits_indices])
        fed = len(tokens)
        tokens.append(int(logits[0].argmax()))
    return tokens[len(ids) :]


def prompt(length: int, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (length,), generator=gen).tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(case, tmp_path, tokenizer_dir):
    family, extra = CASES[case]
    hf = make_hf_model(family, extra)
    lm = load(save_hf_dir(hf, tmp_path / case, tokenizer_dir))
    assert lm.spec.tie_word_embeddings == hf.config.tie_word_embeddings
    ids = prompt(45)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = prefill_logits(lm, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    n = 12
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n)
    assert greedy_paged(lm, ids, n) == out[0, len(ids) :].tolist()


def test_sharded_checkpoint_loads(tmp_path, tokenizer_dir):
    hf = make_hf_model("Qwen3", {"tie_word_embeddings": False}, seed=3)
    path = save_hf_dir(hf, tmp_path / "sharded", tokenizer_dir, max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    ids = prompt(20, seed=2)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(load(path), ids), expected, atol=1e-4, rtol=1e-4)


def test_builtin_tiny_matches_transformers(tokenizer_dir):
    """The generated built-in is a valid Hugging Face checkpoint, computed the same way."""
    lm = load(tokenizer_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tokenizer_dir, dtype=torch.float32)
    ids = lm.tokenizer.encode("The built-in model is an ordinary Qwen3 checkpoint.")
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(lm, ids), expected, atol=1e-4, rtol=1e-4)
