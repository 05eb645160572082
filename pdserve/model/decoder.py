"""The decoder-only transformer (Qwen3 / Llama / Qwen2) over a paged KV cache.

One class covers the three families; the ModelSpec switches the differences (qkv bias, o bias,
mlp bias, per-head q/k RMSNorm, RoPE scaling, tied embeddings). q/k/v and gate/up are fused
into one matmul each (`qkv_proj`, `gate_up_proj`); the loader splits Hugging Face tensors into
their row ranges.

Parameters are created uninitialised (no random init pass): `pdserve.model.loader` fills every
one of them or fails. The rotary table is computed at construction on `device`; the module is
built for one device and dtype and is not meant to be moved afterwards.

Inside the model, modules call their children's `forward` (and linears go through F.linear)
rather than `module(x)`: nn.Module.__call__ costs ~3.5 us of hook bookkeeping per call on
CPU, a decode step makes ~40 such calls, and nothing registers hooks on these modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionMetadata, GatherBuffer, paged_attention, write_kv
from pdserve.model.paged_kv import PagedKV
from pdserve.model.rope import RotaryEmbedding, apply_rotary
from pdserve.model.spec import ModelSpec


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in float32 and cast back (no weight)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of six (a decode step runs 13)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) without nn.Module.__call__ (see the module docstring)."""
    return F.linear(x, layer.weight, layer.bias)


def _store_transposed(linear: nn.Linear) -> None:
    """Give `linear` a weight whose memory is [in, out] row-major (a transposed view).

    F.linear then hands MKL a plain (not transposed) right-hand matrix. On CPU that streams
    the weights 1.3-1.6x faster at the few-row products of decode (batch 1-8) and is no
    slower for prefill; the values and the [out, in] shape the loader fills are unchanged.
    """
    w = linear.weight
    rows_in = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
    linear.weight = nn.Parameter(rows_in.t(), requires_grad=False)


class Attention(nn.Module):
    """Self-attention of one layer: fused qkv, optional q/k norm, RoPE, paged attention."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.sizes = (spec.q_size, spec.kv_size, spec.kv_size)
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.sizes), bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
        scratch: GatherBuffer,
    ) -> torch.Tensor:
        n, s = x.shape[0], self.spec
        qkv = _linear(self.qkv_proj, x)
        # q and k side by side ([n, heads + kv_heads, head_dim]), normed and rotated together:
        # one norm and one rotation instead of two each (a decode step is many small ops).
        qk = qkv[:, : s.q_size + s.kv_size].view(n, s.num_heads + s.num_kv_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size :].view(n, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            qk = self._qk_norm(qk)
        q, k = apply_rotary(qk, *rope).split((s.num_heads, s.num_kv_heads), dim=1)
        write_kv(*kv, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, *kv, meta, scratch)
        return _linear(self.o_proj, out.reshape(n, s.q_size))

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """q_norm on the query heads and k_norm on the key heads, in one normalisation; each
        weight is applied in place to its heads of the fresh output (no weight concat)."""
        s = self.spec
        out = rms_normalize(qk, s.rms_norm_eps)
        out[:, : s.num_heads].mul_(self.q_norm.weight)
        out[:, s.num_heads :].mul_(self.k_norm.weight)
        return out


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self.gate_up_proj, x).chunk(2, dim=-1)
        # in place: gate and up are views of a fresh output used only here (no temporaries)
        return _linear(self.down_proj, F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv: tuple[torch.Tensor, torch.Tensor],
        scratch: GatherBuffer,
    ) -> torch.Tensor:
        normed = self.input_layernorm.forward(x)
        h = x + self.self_attn.forward(normed, rope, meta, kv, scratch)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class Decoder(nn.Module):
    """Token ids in, final-norm hidden states out; `compute_logits` applies the LM head.

    Parameter names mirror the Hugging Face ones without the `model.` prefix, except the fused
    `qkv_proj` and `gate_up_proj` (see pdserve.model.loader).
    """

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            # `_weight` skips the random init: on meta it would import torch._dynamo (~2 s
            # of every instance's start-up) for values the loader overwrites anyway.
            self.embed_tokens = nn.Embedding(
                spec.vocab_size,
                spec.hidden_size,
                _weight=torch.empty(spec.vocab_size, spec.hidden_size),
            )
            self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            if not spec.tie_word_embeddings:
                self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.to(dtype)  # still on meta: free, and never materialises a float32 copy
        self.to_empty(device=device)
        if torch.device(device).type == "cpu":
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    _store_transposed(module)
        self.requires_grad_(False)
        self.scratch = GatherBuffer()  # one forward at a time (see GatherBuffer)
        positions = max_positions or spec.max_position_embeddings
        self.rope = RotaryEmbedding(
            spec.head_dim, positions, spec.rope_theta, spec.rope_scaling, device
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKV,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step over the flattened tokens ([T] ids and positions) -> [T, hidden].

        Writes the step's K/V into `kv` at `meta.slot_mapping`. `on_layer_done(i)` runs right
        after layer i finished (its K/V are in the cache), on this thread: on CUDA the writes
        are only enqueued on the current stream, so a hook that reads the cache from another
        stream or thread must record and wait on an event first.
        """
        x = F.embedding(input_ids, self.embed_tokens.weight)
        rope = self.rope.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, rope, meta, kv.layer(i), self.scratch)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.norm.forward(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden] from `forward`."""
        head = self.embed_tokens if self.spec.tie_word_embeddings else self.lm_head
        return F.linear(hidden, head.weight).float()
