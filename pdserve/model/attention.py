"""Paged attention over the block-table KV cache, in plain torch (same code on CPU and CUDA).

A step feeds a flat list of tokens: the concatenation, in order, of one `SeqSlice` per
sequence. `build_attention_metadata` turns the slices into index tensors once per step; every
layer then reuses them:

1. `write_kv` stores the step's new K/V at `slot_mapping` (slot = block * block_size + offset).
2. `paged_attention` attends:
   - decode slices (num_new == 1) are batched into padded groups: one group in step order
     when all of them fit in its bounded padded size, else sorted by length and cut into
     groups, so one long sequence does not make every short one pay for its length; the
     padding is masked out. Their keys are gathered block-wise through a padded block table
     (into a reused `GatherBuffer`). On CPU in float32 (see `_decode_bags`) the values are
     never gathered: one `embedding_bag` sums the value rows, weighted by the attention
     probabilities, straight from the cache; elsewhere the values are gathered too and one
     SDPA call attends. A group of one sequence (batch-1 decode) has no padding: its K/V
     are cut to its length and SDPA runs unmasked (`_decode_one`);
   - prefill/chunk slices (num_new > 1) get one SDPA call each. A fresh prompt (nothing cached
     before) attends to its own K/V with a plain causal mask; a chunk after a cached prefix
     attends in two parts, the gathered prefix (no mask) and its own K/V (causal), merged by
     their log-sum-exps: a bottom-right-aligned causal mask would send SDPA to its slow
     masked path (2-3x slower on CPU at 2k x 4k).

Grouped-query attention never goes through SDPA's `enable_gqa` (slower on CPU than either
alternative): prefill repeats K/V per query head (a copy of T x kv_heads x head_dim, small
next to the T^2 work), and decode folds each KV head's group of query heads into the query
length (one query per head, so no causal constraint among them) and attends without copies.

Attention always sees K/V as stored in the cache (cast to the cache dtype and back), so a
sequence prefilled in one piece, in chunks, or on another engine gives the same numbers.

Ownership: the caller (model runner) owns the block ids and guarantees that every block in
a block table is allocated to that sequence for the step; this module only reads and writes
the slots those tables name.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step.

    `block_table[i]` is the cache block holding positions [i * block_size, (i + 1) *
    block_size) of the sequence; `num_computed` tokens are already in the cache; this step
    feeds `num_new` tokens at positions num_computed .. num_computed + num_new - 1.
    """

    block_table: Sequence[int]
    num_computed: int
    num_new: int

    @property
    def context_len(self) -> int:
        """Tokens the sequence attends to once this step's tokens are written."""
        return self.num_computed + self.num_new


@dataclass(frozen=True)
class PrefillSlice:
    """Attention work for one slice with num_new > 1, tokens [start, end) of the step.

    `block_ids` ([n_blocks], the blocks holding the cached prefix) is set only when a cached
    prefix exists (`prefix_len` = num_computed > 0); otherwise attention is plain causal over
    the slice's own new K/V.
    """

    start: int
    end: int
    context_len: int
    prefix_len: int
    block_ids: torch.Tensor | None


@dataclass(frozen=True)
class DecodeGroup:
    """Some num_new == 1 slices of a step, attended together over a padded context.

    `token_indices` [B]: their places in the step; `block_tables` [B, max_blocks]: padded with
    block 0 (masked out); `context_lens`: each sequence's context length. The padded-batch
    tensors below are built on first use (the first layer that needs them; the group lives
    for one step), since a one-sequence group needs none of them.
    """

    token_indices: torch.Tensor
    block_tables: torch.Tensor
    context_lens: tuple[int, ...]
    block_size: int
    _bags: dict[tuple[int, int, float], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size], True = attend."""
        device = self.block_tables.device
        ctx = torch.tensor(self.context_lens, dtype=torch.long, device=device)
        keys = torch.arange(self.block_tables.shape[1] * self.block_size, device=device)
        return (keys[None, :] < ctx[:, None]).view(len(self.context_lens), 1, 1, -1)

    @cached_property
    def bias(self) -> torch.Tensor:
        """`mask` as an additive float32 mask (0 / -inf): SDPA would otherwise convert the
        boolean mask again in every layer."""
        return torch.zeros(self.mask.shape, device=self.mask.device).masked_fill_(
            ~self.mask, float("-inf")
        )

    @cached_property
    def slots(self) -> torch.Tensor:
        """[B, max_blocks * block_size]: the cache slot of every padded key position."""
        offsets = torch.arange(self.block_size, device=self.block_tables.device)
        return (self.block_tables.unsqueeze(-1) * self.block_size + offsets).flatten(1)

    def bag_layout(
        self, heads: int, kv_heads: int, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step constants of `_decode_bags`, built by the first layer that asks and kept
        in `_bags` for the others (a group lives for one step).

        `rows` [B, heads, padded]: each query head's value row (slot * kv_heads + its KV
        head) per key position, the bags of `embedding_bag`; `head_scale` [heads, kv_heads,
        1] (float32): `scale` where a query head reads a KV head, else 0.
        """
        key = (heads, kv_heads, scale)
        if key not in self._bags:
            device = self.slots.device
            kv_of_head = torch.arange(heads, device=device) // (heads // kv_heads)
            rows = self.slots.unsqueeze(1) * kv_heads + kv_of_head.view(1, heads, 1)
            reads = kv_of_head[:, None] == torch.arange(kv_heads, device=device)
            self._bags[key] = (rows, reads.unsqueeze(-1) * scale)
        return self._bags[key]


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step index tensors shared by every layer. Built by `build_attention_metadata`.

    `logits_indices` [num_slices]: index in the step of each slice's last new token (the
    rows whose logits the sampler needs). `decode_in_order`: the step is one decode group
    holding every token in step order, so attention needs no reordering of q and out.
    """

    num_tokens: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    prefills: tuple[PrefillSlice, ...]
    decodes: tuple[DecodeGroup, ...]
    decode_in_order: bool = False


DEFAULT_DECODE_GROUP_TOKENS = 32768


def build_attention_metadata(
    slices: Sequence[SeqSlice],
    block_size: int,
    device: torch.device | str,
    decode_group_tokens: int = DEFAULT_DECODE_GROUP_TOKENS,
) -> AttentionMetadata:
    """Index tensors for one step; raises ValueError if a block table is too short.

    Decode slices are sorted by context length and cut into groups whose padded context
    (sequences x longest context) stays within `decode_group_tokens`, which bounds both the
    padding waste and the gather memory of one SDPA call.
    """
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    prefills: list[PrefillSlice] = []
    decodes: list[tuple[int, SeqSlice]] = []
    for s in slices:
        _check_slice(s, block_size)
        start = len(positions)
        if s.num_new == 1:  # decode, the common case: no ranges, no _slots loop
            pos = s.num_computed
            positions.append(pos)
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
            decodes.append((start, s))
        else:
            positions.extend(range(s.num_computed, s.context_len))
            slots.extend(_slots(s, block_size))
            prefills.append(_prefill_slice(s, start, block_size, device))
        last.append(len(positions) - 1)
    groups = _group_decodes(decodes, block_size, decode_group_tokens)
    return AttentionMetadata(
        num_tokens=len(positions),
        positions=long_tensor(positions, device),
        slot_mapping=long_tensor(slots, device),
        logits_indices=long_tensor(last, device),
        prefills=tuple(prefills),
        decodes=tuple(_decode_group(g, block_size, device) for g in groups),
        decode_in_order=len(groups) == 1
        and [i for i, _ in groups[0]] == list(range(len(positions))),
    )


def _check_slice(s: SeqSlice, block_size: int) -> None:
    if s.num_new < 1 or s.num_computed < 0:
        raise ValueError(f"bad slice: num_computed={s.num_computed}, num_new={s.num_new}")
    if len(s.block_table) * block_size < s.context_len:
        raise ValueError(
            f"block table of {len(s.block_table)} blocks x {block_size} cannot hold "
            f"{s.context_len} tokens"
        )


def _slots(s: SeqSlice, block_size: int) -> list[int]:
    """Cache slots of the new tokens, built block by block (one range per block)."""
    out: list[int] = []
    pos, end = s.num_computed, s.context_len
    while pos < end:
        block, offset = divmod(pos, block_size)
        n = min(block_size - offset, end - pos)
        base = s.block_table[block] * block_size
        out.extend(range(base + offset, base + offset + n))
        pos += n
    return out


def _prefill_slice(
    s: SeqSlice, start: int, block_size: int, device: torch.device | str
) -> PrefillSlice:
    end = start + s.num_new
    if s.num_computed == 0:
        return PrefillSlice(start, end, s.context_len, 0, None)
    block_ids = long_tensor(list(s.block_table[: _blocks(s.num_computed, block_size)]), device)
    return PrefillSlice(start, end, s.context_len, s.num_computed, block_ids)


def _group_decodes(
    decodes: list[tuple[int, SeqSlice]], block_size: int, budget: int
) -> list[list[tuple[int, SeqSlice]]]:
    """Split length-sorted decodes so each group's padded size is within `budget` tokens.

    When all of them fit in one group they stay in step order instead: the same padding,
    and attention then needs no reordering of its queries and outputs (decode_in_order).
    """
    if not decodes:
        return []
    widest = max(_blocks(s.context_len, block_size) for _, s in decodes) * block_size
    if widest * len(decodes) <= budget:
        return [decodes]
    groups: list[list[tuple[int, SeqSlice]]] = []
    for item in sorted(decodes, key=lambda d: d[1].context_len):
        padded = _blocks(item[1].context_len, block_size) * block_size
        if groups and padded * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(item)  # sorted: this one is the group's longest
        else:
            groups.append([item])
    return groups


def _decode_group(
    decodes: list[tuple[int, SeqSlice]], block_size: int, device: torch.device | str
) -> DecodeGroup:
    lens = tuple(s.context_len for _, s in decodes)
    width = _blocks(max(lens), block_size)
    tables: list[int] = []  # row-major [len(decodes), width]
    for _, s in decodes:
        used = _blocks(s.context_len, block_size)
        tables += s.block_table[:used]
        tables += [0] * (width - used)  # padded with block 0 (its contents are masked out)
    return DecodeGroup(
        token_indices=long_tensor([i for i, _ in decodes], device),
        block_tables=long_tensor(tables, device).view(len(decodes), width),
        context_lens=lens,
        block_size=block_size,
    )


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def long_tensor(values: list[int], device: torch.device | str) -> torch.Tensor:
    """A 1-D int64 tensor of `values`, made through an `array` buffer that torch wraps as
    is: 3x cheaper than torch.tensor(list) for a block table (per-step metadata cost)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    out = torch.frombuffer(array("q", values), dtype=torch.long)  # keeps the array alive
    return out if torch.device(device).type == "cpu" else out.to(device)


class GatherBuffer:
    """Scratch memory that gathered K/V blocks are copied into.

    Reused by every layer and step, so large gathers do not pay for fresh pages (on CPU a new
    100 MB tensor costs more in page faults than the copy itself). Owned by one Decoder and
    used by one forward at a time; grows to the largest gather seen and never shrinks.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def pair(self, n_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two uninitialised [n_blocks, *like.shape[1:]] tensors (for K and V)."""
        block_numel = math.prod(like.shape[1:])
        need = 2 * n_blocks * block_numel
        buf = self._buf
        if (
            buf is None
            or buf.numel() < need
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = self._buf = torch.empty(need, dtype=like.dtype, device=like.device)
        shape = (n_blocks, *like.shape[1:])
        half = n_blocks * block_numel
        return buf[:half].view(shape), buf[half:need].view(shape)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new K/V ([T, kv_heads, head_dim]) into one layer's cache at `slot_mapping`."""
    heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, _cast(k, k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, _cast(v, v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scratch: GatherBuffer,
) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for q [T, heads, head_dim].

    `k`/`v` are this step's new keys/values, already written by `write_kv`; scale is
    1/sqrt(head_dim).
    """
    if meta.decode_in_order:  # the common all-decode step: skip three copies per layer
        return _decode(q, k_cache, v_cache, meta.decodes[0], scratch)
    out = torch.empty_like(q)
    for p in meta.prefills:
        out[p.start : p.end] = _prefill(q[p.start : p.end], k, v, k_cache, v_cache, p, scratch)
    for g in meta.decodes:
        q_g = q.index_select(0, g.token_indices)
        out.index_copy_(0, g.token_indices, _decode(q_g, k_cache, v_cache, g, scratch))
    return out


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    p: PrefillSlice,
    scratch: GatherBuffer,
) -> torch.Tensor:
    """Attention of one prefill slice's queries ([n, heads, head_dim]) -> same shape."""
    q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    group = q.shape[1] // k.shape[1]
    new_k = _as_cached(k[p.start : p.end], k_cache.dtype)
    new_v = _as_cached(v[p.start : p.end], v_cache.dtype)
    if p.block_ids is None:
        # GQA inside the kernel instead of repeated K/V copies: the same values, 8-12% less
        # time per 1024-token layer here (docs/results.md, "GQA inside the attention kernel")
        first_k, first_v = _heads_first(new_k, 1), _heads_first(new_v, 1)
        out = F.scaled_dot_product_attention(q, first_k, first_v, is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    new_k, new_v = _heads_first(new_k, group), _heads_first(new_v, group)
    keys, values = _gather(k_cache, v_cache, p.block_ids, scratch)
    old_k = _heads_first(keys.flatten(0, 1)[: p.prefix_len].to(q.dtype), group)
    old_v = _heads_first(values.flatten(0, 1)[: p.prefix_len].to(q.dtype), group)
    return _attend_after_prefix(q, old_k, old_v, new_k, new_v)[0].transpose(0, 1)


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """[T, kv_heads, d] -> [1, kv_heads * group, T, d], each KV head repeated for its group."""
    x = x.transpose(0, 1).unsqueeze(0)
    return x.repeat_interleave(group, dim=1) if group > 1 else x


def _attend_after_prefix(
    q: torch.Tensor,
    old_k: torch.Tensor,
    old_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
) -> torch.Tensor:
    """Queries at the end of a context: all of the prefix (old) plus causal over the new part.

    On CPU the two halves run in SDPA's flash kernel, each returning its log-sum-exp, and are
    merged exactly; elsewhere one masked SDPA call does it.
    """
    if q.device.type != "cpu":
        n, prefix = q.shape[2], old_k.shape[2]
        keys = torch.arange(prefix + n, device=q.device)
        mask = keys[None, :] <= torch.arange(prefix, prefix + n, device=q.device)[:, None]
        k, v = torch.cat((old_k, new_k), dim=2), torch.cat((old_v, new_v), dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out_old, lse_old = flash(q, old_k, old_v)
    out_new, lse_new = flash(q, new_k, new_v, is_causal=True)
    lse = torch.logaddexp(lse_old, lse_new)
    w_old = torch.exp(lse_old - lse).unsqueeze(-1)
    w_new = torch.exp(lse_new - lse).unsqueeze(-1)
    return (out_old.float() * w_old + out_new.float() * w_new).to(q.dtype)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    scratch: GatherBuffer,
) -> torch.Tensor:
    """Attention of a decode group's queries ([B, heads, head_dim]) -> same shape."""
    if q.shape[0] == 1:
        return _decode_one(q, k_cache, v_cache, g, scratch)
    if _bags_apply(q, k_cache, v_cache):
        return _decode_bags(q, k_cache, v_cache, g, scratch)
    return _decode_sdpa(q, k_cache, v_cache, g, scratch)


BAGS_MIN_BATCH = 4


def _bags_apply(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `_decode_bags` serves this group.

    CPU float32 only (measured there; other dtypes take embedding_bag's slow paths); at most
    4 KV heads (its score matmul does kv_heads times the needed multiply-adds: free while
    decode is memory-bound, not with many KV heads); and from BAGS_MIN_BATCH sequences on:
    below that the two paths measured the same within noise, and SDPA is the simpler one.
    """
    return (
        q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.shape[-2] <= 4
        and q.shape[0] >= BAGS_MIN_BATCH
    )


def _decode_bags(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    scratch: GatherBuffer,
) -> torch.Tensor:
    """Decode attention that gathers only the keys (CPU float32).

    SDPA needs gathered, padded K and V; its CPU kernel and the two copies cost ~3x the
    bytes of reading the context once. Here the keys are gathered (one block-wise copy) and
    scored by one batched matmul of the contiguous [padded, kv_heads * head_dim] keys with a
    block-diagonal query (each query head zero outside its KV head: MKL ran this tall shape
    1.6-1.8x faster than per-head or transposed forms). The values are summed straight
    from the cache by `embedding_bag`, weighted by the probabilities (padding has weight 0;
    the cache holds no NaN, see KVCache.allocate).
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    rows, head_scale = g.bag_layout(heads, kv_heads, dim**-0.5)
    keys = scratch.pair(g.block_tables.numel(), k_cache)[0]  # the V half stays unused
    torch.index_select(k_cache, 0, g.block_tables.flatten(), out=keys)
    wide_q = (q.unsqueeze(2) * head_scale).view(batch, heads, kv_heads * dim)
    scores = torch.bmm(keys.view(batch, -1, kv_heads * dim), wide_q.transpose(1, 2))
    # Masked into a contiguous [B, heads, padded] tensor: softmax then runs over contiguous
    # rows, and the weights are already in embedding_bag's order (no copy).
    masked = torch.empty(batch, heads, scores.shape[1], dtype=q.dtype, device=q.device)
    torch.add(scores.transpose(1, 2), g.bias.view(batch, 1, -1), out=masked)
    out = F.embedding_bag(
        rows.view(batch * heads, -1),
        v_cache.view(-1, dim),
        mode="sum",
        per_sample_weights=torch.softmax(masked, dim=-1).view(batch * heads, -1),
    )
    return out.view(batch, heads, dim)


def _decode_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    scratch: GatherBuffer,
) -> torch.Tensor:
    """A one-sequence group: SDPA over its gathered K/V cut to its context, no mask.

    Without padding there is nothing to mask (SDPA's unmasked CPU kernel, and no mask to
    build); the same numbers as `_decode_sdpa` up to float rounding.
    """
    _, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    n = g.context_lens[0]
    keys, values = _gather(k_cache, v_cache, g.block_tables[0], scratch)
    out = F.scaled_dot_product_attention(
        q.view(1, kv_heads, heads // kv_heads, dim),  # a KV head's query heads as queries
        _cast(keys.view(1, -1, kv_heads, dim)[:, :n], q.dtype).transpose(1, 2),
        _cast(values.view(1, -1, kv_heads, dim)[:, :n], q.dtype).transpose(1, 2),
    )
    return out.view(1, heads, dim)


def _decode_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    scratch: GatherBuffer,
) -> torch.Tensor:
    """Decode attention over gathered K and V in one masked SDPA call (any device/dtype)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[-2]
    keys, values = _gather(k_cache, v_cache, g.block_tables.flatten(), scratch)
    keys = keys.view(batch, -1, kv_heads, dim)
    values = values.view(batch, -1, kv_heads, dim)
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, heads // kv_heads, dim),  # a KV head's query heads as queries
        keys.to(q.dtype).transpose(1, 2),
        values.to(q.dtype).transpose(1, 2),
        attn_mask=g.bias.to(q.dtype),
    )
    return out.reshape(batch, heads, dim)


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, scratch: GatherBuffer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the given blocks ([n, block_size, kv_heads, head_dim] each), in order."""
    keys, values = scratch.pair(block_ids.numel(), k_cache)
    torch.index_select(k_cache, 0, block_ids, out=keys)
    torch.index_select(v_cache, 0, block_ids, out=values)
    return keys, values


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; skips the dispatch of a no-op `.to` (per-layer decode overhead)."""
    return x if x.dtype == dtype else x.to(dtype)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x rounded as the cache stores it (a no-op when the dtypes match)."""
    return x.to(cache_dtype).to(x.dtype)
