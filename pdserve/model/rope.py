"""Rotary position embedding, Hugging Face / GPT-NeoX layout (rotate_half over two halves).

The cos/sin table is computed once per model (float32, for every position up to the model's
length) and indexed by the step's positions; the per-step cost is one gather and three
elementwise ops per rotation (the sign of rotate_half is folded into the sin table).
Frequencies follow transformers' `modeling_rope_utils` exactly so logits match.
"""

from __future__ import annotations

import math

import torch

from pdserve.model.spec import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, shape [head_dim // 2]) with optional scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {scaling.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the middle band."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin table for positions [0, max_positions); owns only that table.

    Not an nn.Module on purpose: the table is derived state, not a weight, and must never be
    touched by `load_state_dict` or `to_empty`.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling | None,
        device: torch.device | str,
    ) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_positions = max_positions
        # [max_positions, 1, head_dim]: rows come out in the shape apply_rotary broadcasts
        self.cos = emb.cos().unsqueeze(1).to(device)
        sin = emb.sin()
        # rotate_half(x) * sin == swap_halves(x) * signed_sin: the negation moves into the
        # table (exact in IEEE), saving a negation per rotation.
        self.signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), -1)
        self.signed_sin = self.signed_sin.unsqueeze(1).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and signed sin rows for `positions` ([T] -> two [T, 1, head_dim]) in `dtype`.

        The pair `apply_rotary` takes: signed sin is sin with its first half negated.
        """
        cos = self.cos.index_select(0, positions)
        sin = self.signed_sin.index_select(0, positions)
        if dtype != cos.dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x ([T, heads, head_dim]) by the per-token angles from `RotaryEmbedding.cos_sin`
    ([T, 1, head_dim] each): x * cos + rotate_half(x) * sin, in three ops."""
    return torch.addcmul(x * cos, swap_halves(x), signed_sin)
