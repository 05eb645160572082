"""KVCache: one contiguous region whose byte spans match the tensor views."""

from __future__ import annotations

import ctypes

import msgspec
import pytest
import torch

from pdserve.kv.cache import LAYOUT, KVCache, KVCompat, num_blocks_for_budget
from pdserve.model.spec import ModelSpec

SPEC = ModelSpec.from_hf_config(
    {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
)


def bytes_at(kv: KVCache, offset: int, length: int) -> bytes:
    return ctypes.string_at(kv.data_ptr() + offset, length)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_span_matches_memory(dtype):
    kv = KVCache.allocate(SPEC, num_blocks=5, block_size=4, dtype=dtype, device="cpu")
    assert kv.tensor.shape == (3, 2, 5, 4, 2, 8) and kv.tensor.is_contiguous()
    assert kv.block_nbytes == 4 * 2 * 8 * dtype.itemsize
    assert kv.nbytes == 3 * 2 * 5 * kv.block_nbytes
    gen = torch.Generator().manual_seed(0)
    for layer in range(3):
        for view in kv.layer(layer):
            view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    for layer, part, first, n in [(0, 0, 0, 1), (1, 1, 2, 3), (2, 0, 4, 1), (2, 1, 0, 5)]:
        offset, length = kv.span(layer, part, first, n)
        expected = kv.layer(layer)[part][first : first + n]
        assert length == n * kv.block_nbytes
        assert bytes_at(kv, offset, length) == tensor_bytes(expected)


def test_span_bounds():
    kv = KVCache.allocate(SPEC, 5, 4, torch.float32, "cpu")
    assert kv.span(2, 1, 4, 1)[0] + kv.block_nbytes == kv.nbytes  # last block ends the region
    for args in [(3, 0, 0, 1), (0, 2, 0, 1), (0, 0, 4, 2), (0, 0, -1, 1)]:
        with pytest.raises(IndexError):
            kv.span(*args)


def test_allocation_is_zeroed_and_views_share_memory():
    kv = KVCache.allocate(SPEC, 2, 4, torch.float32, "cpu")
    assert kv.tensor.abs().sum() == 0
    k, _ = kv.layer(1)
    k[1, 2, 0, 3] = 5.0
    assert kv.tensor[1, 0, 1, 2, 0, 3] == 5.0


def test_num_blocks_for_budget():
    per_block = SPEC.kv_bytes_per_token(torch.float32) * 16
    assert num_blocks_for_budget(SPEC, per_block * 10 + per_block - 1, 16, "float32") == 10
    assert num_blocks_for_budget(SPEC, per_block * 10, 16, torch.bfloat16) == 20


def test_compat_fingerprint_round_trips():
    kv = KVCache.allocate(SPEC, 2, 16, torch.bfloat16, "cpu")
    fp = kv.compat_fingerprint()
    assert fp == KVCompat("bfloat16", 3, 2, 8, 16, LAYOUT)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(fp), type=KVCompat) == fp
    other = KVCache.allocate(SPEC, 7, 16, torch.float32, "cpu").compat_fingerprint()
    assert other != fp


def test_rejects_non_positive_blocks():
    with pytest.raises(ValueError):
        KVCache.allocate(SPEC, 0, 16, torch.float32, "cpu")
