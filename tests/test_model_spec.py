"""ModelSpec parsing of Hugging Face configs (both RoPE spellings, the three families)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.spec import ModelSpec, RopeScaling

BASE = {
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
}


def config(arch: str, **extra) -> dict:
    return {"architectures": [arch], **BASE, **extra}


def test_qwen3_classic_config():
    spec = ModelSpec.from_hf_config(
        config(
            "Qwen3ForCausalLM",
            head_dim=32,
            rope_theta=1e6,
            tie_word_embeddings=True,
            eos_token_id=[7, 9],
            torch_dtype="bfloat16",
        )
    )
    assert spec.family == "qwen3" and spec.qk_norm and not spec.qkv_bias and not spec.o_bias
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 2, 32)
    assert spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert spec.eos_token_ids == (7, 9) and spec.torch_dtype == "bfloat16"
    assert spec.tie_word_embeddings
    hash(spec)  # frozen and hashable


def test_llama3_rope_scaling_legacy_and_v5_spellings_agree():
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    legacy = ModelSpec.from_hf_config(
        config(
            "LlamaForCausalLM",
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", **scaling},
            attention_bias=True,
            eos_token_id=3,
            dtype="float16",
        )
    )
    v5 = ModelSpec.from_hf_config(
        config(
            "LlamaForCausalLM",
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **scaling},
            attention_bias=True,
            eos_token_id=3,
            dtype="float16",
        )
    )
    assert legacy == v5
    assert legacy.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert legacy.head_dim == 16  # hidden / heads when head_dim is absent
    assert legacy.qkv_bias and legacy.o_bias and not legacy.qk_norm
    assert legacy.eos_token_ids == (3,) and legacy.torch_dtype == "float16"


def test_linear_rope_old_type_key():
    spec = ModelSpec.from_hf_config(
        config("LlamaForCausalLM", rope_scaling={"type": "linear", "factor": 2.0})
    )
    assert spec.rope_scaling == RopeScaling("linear", 2.0)


def test_qwen2_has_qkv_bias_only():
    spec = ModelSpec.from_hf_config(config("Qwen2ForCausalLM"))
    assert spec.family == "qwen2" and spec.qkv_bias and not spec.o_bias and not spec.qk_norm


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError) as err:
        ModelSpec.from_hf_config(config("MistralForCausalLM"))
    message = str(err.value)
    assert "MistralForCausalLM" in message
    for arch in ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM"):
        assert arch in message


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "sliding"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_unsupported_features_are_rejected(extra, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(config("Qwen2ForCausalLM", **extra))


def test_kv_bytes_per_token():
    spec = ModelSpec.from_hf_config(config("Qwen3ForCausalLM", head_dim=32))
    assert spec.kv_bytes_per_token(torch.float32) == 2 * 3 * 2 * 32 * 4
    assert spec.kv_bytes_per_token("bfloat16") == 2 * 3 * 2 * 32 * 2
