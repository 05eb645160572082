"""ModelSpec: the architecture facts pdserve needs, parsed once from a Hugging Face config.json.

Everything downstream (decoder, KV cache sizing, loader, transfer handshakes) reads the spec,
never the raw config dict, so one parser decides how each family spells its fields.

Supported families:

- Qwen3 (`Qwen3ForCausalLM`): RMSNorm on each query/key head (q_norm/k_norm), no qkv bias.
- Llama (`LlamaForCausalLM`): optional `attention_bias` (q/k/v/o), optional `mlp_bias`,
  rope scaling `linear` and `llama3`.
- Qwen2 (`Qwen2ForCausalLM`): bias on q/k/v, none on o.

Both config spellings of RoPE are accepted: the classic `rope_theta` + `rope_scaling` (what
published checkpoints carry) and transformers 5's `rope_parameters` (what `save_pretrained`
writes today).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

SUPPORTED_ARCHITECTURES: Mapping[str, str] = MappingProxyType(
    {
        "Qwen3ForCausalLM": "qwen3",
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
    }
)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }
)


def torch_dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    """Map "float32" / "bfloat16" / "float16" (or a torch.dtype) to the torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def dtype_name(dtype: torch.dtype | str) -> str:
    """The short name ("float32", "bfloat16", "float16") of a dtype."""
    return str(torch_dtype_of(dtype)).removeprefix("torch.")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `linear` divides every frequency by `factor`; `llama3` divides
    only the low frequencies, blending in between (Llama 3.1's recipe, see pdserve.model.rope).
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """Immutable description of a decoder-only transformer checkpoint.

    `rope_scaling` is None for plain RoPE. Hashable, so it can key caches.
    """

    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # the checkpoint's dtype; "float32" when config.json names none

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Parse a config.json dict; raises ValueError for anything this decoder cannot run."""
        arch = _architecture(config)
        family = SUPPORTED_ARCHITECTURES[arch]
        _reject_unsupported_features(config, arch)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        attention_bias = bool(config.get("attention_bias", False))
        rope_theta, rope_scaling = _rope(config)
        spec = cls(
            family=family,
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)) if family == "llama" else False,
            qk_norm=family == "qwen3",
            bos_token_id=_optional_int(config.get("bos_token_id")),
            eos_token_ids=_int_tuple(config.get("eos_token_id")),
            torch_dtype=_config_dtype(config),
        )
        spec._validate()
        return spec

    def kv_bytes_per_token(self, dtype: torch.dtype | str) -> int:
        """Bytes of K and V, all layers, for one token."""
        itemsize = torch_dtype_of(dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def q_size(self) -> int:
        """Width of the query projection (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection (num_kv_heads * head_dim)."""
        return self.num_kv_heads * self.head_dim

    def _validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


def _architecture(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) if archs else f"none (model_type={config.get('model_type')!r})"
    raise ValueError(
        f"unsupported architecture: {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _reject_unsupported_features(config: Mapping[str, Any], arch: str) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (only 'silu')")
    if config.get("use_sliding_window"):
        raise ValueError(f"{arch}: sliding-window attention is not supported")
    partial = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if config.get("partial_rotary_factor", partial) != 1.0:
        raise ValueError(f"{arch}: partial rotary embeddings are not supported")


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either config spelling; scaling None means plain RoPE."""
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    return theta, RopeScaling(
        rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _config_dtype(config: Mapping[str, Any]) -> str:
    raw = config.get("torch_dtype") or config.get("dtype")
    return dtype_name(raw) if raw else "float32"


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
