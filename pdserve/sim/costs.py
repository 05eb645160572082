"""Roofline costs: how long one engine step, one descriptor post and one KV transfer take.

Step time = max(FLOPs / (tp * peak * flops_efficiency), bytes / (tp * mem_bw *
mem_bw_efficiency)) + tensor-parallel all-reduces + host overheads. All inputs are the
profiles and the step's shape (which sequences, how many new tokens, how much context);
nothing here keeps state, so every figure can be checked by hand:

- FLOPs: 2 per weight per token for the decoder's linear layers, 2 per LM-head weight per
  sampled sequence, and attention's QK^T and PV, 4 * heads * head_dim per (query, key)
  pair per layer, with causal pairs n*c + n(n+1)/2 for n new tokens after c cached ones.
- Bytes: every weight once per step (the input embedding table is gathered, not read, so
  it counts only when tied to the LM head), the cached KV read once per sequence, the new
  KV written once. Activations are left out (small next to weights and KV).
- All-reduce: two per layer (after attention and after the MLP) of tokens * hidden values,
  ring cost 2(tp-1)/tp * bytes / bandwidth plus a fixed latency each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.sim.profiles import HardwareProfile, ModelProfile, SoftwareProfile


@dataclass(frozen=True)
class SeqWork:
    """One sequence's part of a step: `num_new` tokens after `num_cached` in its cache;
    `samples` when the step reaches the end of its known tokens (a logit row is computed)."""

    num_new: int
    num_cached: int
    samples: bool


def layer_linear_params(m: ModelProfile) -> int:
    """Weights of one decoder layer's projections (q, k, v, o and the gated MLP)."""
    q_out = m.num_heads * m.head_dim
    kv_out = m.num_kv_heads * m.head_dim
    attn = m.hidden_size * (q_out + 2 * kv_out) + q_out * m.hidden_size
    return attn + 3 * m.hidden_size * m.intermediate_size


def kv_bytes_per_token(m: ModelProfile) -> int:
    """K and V of one token over all layers."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.dtype_bytes


def weight_bytes_per_step(m: ModelProfile) -> float:
    """Weights read by one forward pass (an untied input embedding is only gathered)."""
    untied_embedding = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    return float((m.num_params - untied_embedding) * m.dtype_bytes)


def attention_pairs(num_new: int, num_cached: int) -> int:
    """(query, key) pairs of causal attention for `num_new` tokens after `num_cached`."""
    return num_new * num_cached + num_new * (num_new + 1) // 2


def step_flops(m: ModelProfile, seqs: Sequence[SeqWork]) -> float:
    """FLOPs of one forward pass over `seqs` (whole model, all TP ranks together)."""
    tokens = sum(s.num_new for s in seqs)
    sampled = sum(1 for s in seqs if s.samples)
    linear = 2 * tokens * m.num_layers * layer_linear_params(m)
    head = 2 * sampled * m.vocab_size * m.hidden_size
    pairs = sum(attention_pairs(s.num_new, s.num_cached) for s in seqs)
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * pairs
    return float(linear + head + attention)


def step_bytes(m: ModelProfile, seqs: Sequence[SeqWork]) -> float:
    """Memory traffic of one forward pass: weights + KV read + KV written."""
    kv_tokens = sum(s.num_cached + 2 * s.num_new for s in seqs)
    return weight_bytes_per_step(m) + kv_tokens * kv_bytes_per_token(m)


def allreduce_time(m: ModelProfile, hw: HardwareProfile, tp: int, tokens: int) -> float:
    """Two ring all-reduces per layer of `tokens` hidden states; 0 without TP."""
    if tp == 1:
        return 0.0
    size = tokens * m.hidden_size * m.dtype_bytes
    ring = 2 * (tp - 1) / tp * size / hw.allreduce_bw if hw.allreduce_bw > 0 else 0.0
    return 2 * m.num_layers * (hw.allreduce_latency_s + ring)


@dataclass(frozen=True)
class StepCost:
    """The parts of one step's duration, seconds."""

    compute: float  # FLOPs at the achieved rate
    memory: float  # bytes at the achieved bandwidth
    allreduce: float
    overhead: float  # host work

    @property
    def total(self) -> float:
        return max(self.compute, self.memory) + self.allreduce + self.overhead


@dataclass(frozen=True)
class CostModel:
    """Step, post and transfer durations for one instance of `model` on `tp` devices."""

    model: ModelProfile
    hardware: HardwareProfile
    software: SoftwareProfile
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError("tp must be >= 1")

    def step(self, seqs: Sequence[SeqWork]) -> StepCost:
        """Duration of one forward pass over `seqs` (an empty step costs nothing)."""
        if not seqs:
            return StepCost(0.0, 0.0, 0.0, 0.0)
        hw, sw = self.hardware, self.software
        flops_rate = self.tp * hw.peak_flops * hw.flops_efficiency
        byte_rate = self.tp * hw.mem_bw * hw.mem_bw_efficiency
        tokens = sum(s.num_new for s in seqs)
        return StepCost(
            compute=step_flops(self.model, seqs) / flops_rate,
            memory=step_bytes(self.model, seqs) / byte_rate,
            allreduce=allreduce_time(self.model, hw, self.tp, tokens),
            overhead=sw.step_overhead_s + sw.seq_overhead_s * len(seqs),
        )

    def step_time(self, seqs: Sequence[SeqWork]) -> float:
        return self.step(seqs).total

    def kv_bytes(self, num_tokens: int, num_layers: int | None = None) -> float:
        """KV bytes of `num_tokens` tokens over `num_layers` layers (default: all)."""
        layers = self.model.num_layers if num_layers is None else num_layers
        return kv_bytes_per_token(self.model) * num_tokens * layers / self.model.num_layers

    def descriptors(self, num_tokens: int, num_layers: int | None = None) -> int:
        """Descriptors one TP rank posts to move `num_tokens` tokens' KV of `num_layers`."""
        layers = self.model.num_layers if num_layers is None else num_layers
        blocks = math.ceil(num_tokens / self.software.block_size)
        runs = math.ceil(blocks / self.software.blocks_per_descriptor)
        return 2 * layers * runs

    def post_time(self, num_tokens: int, num_layers: int | None = None) -> float:
        """Building and posting one transfer's descriptors (ranks in parallel)."""
        sw = self.software
        return sw.post_fixed_s + sw.per_descriptor_s * self.descriptors(num_tokens, num_layers)

    def transfer_time(self, num_bytes: float) -> float:
        """Wire time of `num_bytes` split over the TP ranks' network shares, plus latency."""
        return self.wire_time(num_bytes) + self.hardware.net_latency_s

    def wire_time(self, num_bytes: float) -> float:
        """Serialisation time of `num_bytes` on the instance's network share (no latency)."""
        return num_bytes / (self.tp * self.hardware.net_bw_per_device)

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV the instance can hold: its share of device memory minus weights."""
        hw, sw = self.hardware, self.software
        free = self.tp * hw.mem_capacity * sw.kv_memory_fraction
        free -= weight_bytes_per_step(self.model) + self._untied_embedding_bytes()
        return max(0, int(free // kv_bytes_per_token(self.model)))

    def _untied_embedding_bytes(self) -> float:
        m = self.model
        return 0.0 if m.tie_word_embeddings else float(m.vocab_size * m.hidden_size * m.dtype_bytes)
