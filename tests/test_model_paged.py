"""Paged attention: chunking, batching and block placement do not change the numbers."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.kv.cache import KVCache
from pdserve.model.attention import SeqSlice, build_attention_metadata
from pdserve.model.loader import LoadedModel, load_model

BLOCK = 16
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LoadedModel:
    cfg = ModelConfig(model="builtin:tiny", cache_dir=tmp_path_factory.mktemp("models"))
    return load_model(cfg)


def fresh_cache(lm: LoadedModel) -> KVCache:
    return KVCache.allocate(lm.spec, NUM_BLOCKS, BLOCK, lm.dtype, "cpu")


def step(lm: LoadedModel, kv: KVCache, feeds: list[tuple[SeqSlice, list[int]]], **kw):
    """One forward over several slices; returns logits at every fed token, and the metadata."""
    meta = build_attention_metadata([s for s, _ in feeds], BLOCK, "cpu", **kw)
    ids = torch.tensor([t for _, toks in feeds for t in toks])
    hidden = lm.model(ids, meta.positions, meta, kv)
    return lm.model.compute_logits(hidden), meta


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


def shuffled_tables(n_seqs: int, blocks_each: int, seed: int = 0) -> list[list[int]]:
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(n_seqs)]


def test_chunked_prefill_matches_one_shot(tiny):
    ids = prompt(70, seed=1)
    ref, _ = step(tiny, fresh_cache(tiny), [(SeqSlice(list(range(5)), 0, len(ids)), ids)])
    kv, table = fresh_cache(tiny), shuffled_tables(1, 5)[0]
    rows, done = [], 0
    for size in (17, 1, 15, 2, 35):  # crosses block edges; a 1-token chunk is a decode slice
        logits, _ = step(tiny, kv, [(SeqSlice(table, done, size), ids[done : done + size])])
        rows.append(logits)
        done += size
    torch.testing.assert_close(torch.cat(rows), ref, atol=1e-5, rtol=1e-5)


def run_alone(lm: LoadedModel, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and last-token logits of one sequence run by itself."""
    kv, table = fresh_cache(lm), list(range(NUM_BLOCKS))
    tokens, fed, history = list(ids), 0, []
    while len(tokens) < len(ids) + n:
        logits, meta = step(lm, kv, [(SeqSlice(table, fed, len(tokens) - fed), tokens[fed:])])
        history.append(logits[meta.logits_indices[0]])
        fed = len(tokens)
        tokens.append(int(history[-1].argmax()))
    return tokens[len(ids) :], history


@pytest.mark.parametrize("group_tokens", [32768, 40])  # one decode group / one per sequence
def test_batched_decode_matches_unbatched(tiny, group_tokens):
    """Sequences of different lengths, prefilled and decoded together (a late joiner's
    prefill shares steps with the others' decodes), equal each sequence run alone."""
    prompts = [prompt(n, seed=n) for n in (5, 37, 80, 23)]
    n_new = 6
    alone = [run_alone(tiny, p, n_new) for p in prompts]
    kv, tables = fresh_cache(tiny), shuffled_tables(len(prompts), 6, seed=7)
    tokens = [list(p) for p in prompts]
    fed = [0] * len(prompts)
    seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    for t in range(n_new + 1):
        active = [i for i in range(len(prompts)) if (i < 3 or t > 0) and len(seen[i]) < n_new]
        feeds = [
            (SeqSlice(tables[i], fed[i], len(tokens[i]) - fed[i]), tokens[i][fed[i] :])
            for i in active
        ]
        logits, meta = step(tiny, kv, feeds, decode_group_tokens=group_tokens)
        for row, i in enumerate(active):
            seen[i].append(logits[meta.logits_indices[row]])
            fed[i] = len(tokens[i])
            tokens[i].append(int(seen[i][-1].argmax()))
    for i, (want_tokens, want_logits) in enumerate(alone):
        assert tokens[i][len(prompts[i]) :] == want_tokens
        torch.testing.assert_close(
            torch.stack(seen[i]), torch.stack(want_logits), atol=1e-5, rtol=1e-5
        )


def test_metadata_slots_positions_and_logits_indices():
    slices = [SeqSlice([7, 2], 14, 3), SeqSlice([5], 0, 1), SeqSlice([9, 4, 1], 30, 1)]
    meta = build_attention_metadata(slices, 16, "cpu")
    assert meta.num_tokens == 5
    assert meta.positions.tolist() == [14, 15, 16, 0, 30]
    assert meta.slot_mapping.tolist() == [7 * 16 + 14, 7 * 16 + 15, 2 * 16 + 0, 5 * 16, 4 * 16 + 14]
    assert meta.logits_indices.tolist() == [2, 3, 4]
    (chunk,) = meta.prefills
    assert chunk.prefix_len == 14 and chunk.block_ids.tolist() == [7]  # only the prefix's blocks
    (group,) = meta.decodes
    assert sorted(group.token_indices.tolist()) == [3, 4]
    assert group.mask.sum().item() == 1 + 31
    assert group.slots[1, :3].tolist() == [9 * 16, 9 * 16 + 1, 9 * 16 + 2]
    assert not meta.decode_in_order  # a prefill shares the step


@pytest.mark.parametrize(
    "lens, group_tokens, in_order",
    [
        ([40, 10], 32768, True),  # one group: kept in step order, not sorted by length
        ([40, 10], 48, False),  # two groups (sorted by length): attention reorders
        ([10, 40], 48, False),
        ([7], 32768, True),
    ],
)
def test_metadata_flags_decode_only_steps_in_step_order(lens, group_tokens, in_order):
    tables = shuffled_tables(len(lens), 3)
    slices = [SeqSlice(t, n - 1, 1) for t, n in zip(tables, lens, strict=True)]
    meta = build_attention_metadata(slices, BLOCK, "cpu", decode_group_tokens=group_tokens)
    assert meta.decode_in_order is in_order
    assert sorted(i for g in meta.decodes for i in g.token_indices.tolist()) == [*range(len(lens))]


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([SeqSlice([0, 1], 30, 3)], 16, "cpu")


def test_on_layer_done_sees_that_layers_kv(tiny):
    kv, ids = fresh_cache(tiny), prompt(20, seed=3)
    meta = build_attention_metadata([SeqSlice([3, 8], 0, len(ids))], BLOCK, "cpu")
    calls: list[int] = []

    def hook(layer: int) -> None:
        calls.append(layer)
        k, v = kv.layer(layer)
        assert k.flatten(0, 1)[meta.slot_mapping].abs().sum() > 0
        assert v.flatten(0, 1)[meta.slot_mapping].abs().sum() > 0
        if layer + 1 < tiny.spec.num_layers:  # later layers are not written yet
            assert kv.layer(layer + 1)[0].abs().sum() == 0

    tiny.model(torch.tensor(ids), meta.positions, meta, kv, on_layer_done=hook)
    assert calls == list(range(tiny.spec.num_layers))


def test_bfloat16_runs(tmp_path):
    lm = load_model(ModelConfig(model="builtin:tiny", dtype="bfloat16", cache_dir=tmp_path))
    kv = KVCache.allocate(lm.spec, 8, BLOCK, lm.dtype, "cpu")
    assert kv.dtype == torch.bfloat16
    logits, _ = step(lm, kv, [(SeqSlice([0, 1], 0, 20), prompt(20, seed=4))])
    assert logits.dtype == torch.float32 and logits.shape == (20, lm.spec.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("prefix, new", [(1, 5), (13, 16), (37, 2)])
def test_chunk_after_prefix_equals_masked_attention(prefix, new):
    from pdserve.model.attention import _attend_after_prefix

    g = torch.Generator().manual_seed(prefix)
    q = torch.randn(1, 4, new, 8, generator=g)
    k = torch.randn(1, 4, prefix + new, 8, generator=g)
    v = torch.randn(1, 4, prefix + new, 8, generator=g)
    keys = torch.arange(prefix + new)
    mask = keys[None, :] <= torch.arange(prefix, prefix + new)[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    split = (k[:, :, :prefix], v[:, :, :prefix], k[:, :, prefix:], v[:, :, prefix:])
    got = _attend_after_prefix(q, split[0], split[1], split[2], split[3])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def decode_inputs(lens: list[int], heads: int, kv_heads: int, seed: int):
    """Random queries, a shuffled paged cache and the decode group for contexts `lens`."""
    g = torch.Generator().manual_seed(seed)
    dim, blocks_each = 8, -(-max(lens) // BLOCK)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, kv_heads, dim, generator=g)
    tables = shuffled_tables(len(lens), blocks_each, seed)
    slices = [SeqSlice(t, n - 1, 1) for t, n in zip(tables, lens, strict=True)]
    (group,) = build_attention_metadata(slices, BLOCK, "cpu").decodes
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q[group.token_indices], k_cache, v_cache, group, tables


def reference_decode(q, k_cache, v_cache, tables, lens, token_order) -> torch.Tensor:
    """Each sequence alone: plain SDPA over exactly its context, no padding, no mask."""
    heads, kv_heads = q.shape[1], k_cache.shape[-2]
    out = []
    for row, i in enumerate(token_order):
        n, table = lens[i], torch.tensor(tables[i])
        keys = k_cache[table].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, dim]
        values = v_cache[table].flatten(0, 1)[:n].transpose(0, 1)
        rep = heads // kv_heads
        keys, values = keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(q[row, :, None], keys, values))
    return torch.stack(out)[:, :, 0]


@pytest.mark.parametrize(
    "lens, heads, kv_heads",
    [
        ([37], 4, 2),  # one sequence
        ([5, 16, 17, 33, 64, 1, 40], 4, 2),  # mixed lengths: padding masked out
        ([20, 20, 20, 20], 6, 3),  # equal lengths, 2 query heads per KV head
        ([3, 48, 9, 31, 16], 4, 4),  # no grouping
        ([12, 50, 7, 29], 4, 1),  # one KV head for all
    ],
)
def test_decode_paths_equal_each_sequence_alone(lens, heads, kv_heads):
    from pdserve.model.attention import GatherBuffer, _decode_bags, _decode_sdpa

    q, k_cache, v_cache, group, tables = decode_inputs(lens, heads, kv_heads, seed=len(lens))
    order = group.token_indices.tolist()  # sequence i fed as token i of the step
    want = reference_decode(q, k_cache, v_cache, tables, lens, order)
    for path in (_decode_bags, _decode_sdpa):
        got = path(q, k_cache, v_cache, group, GatherBuffer())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "n, heads, kv_heads",
    [(1, 4, 2), (16, 4, 2), (17, 4, 2), (37, 6, 3), (64, 4, 4), (50, 4, 1)],
)
def test_decode_one_equals_the_sequence_alone(n, heads, kv_heads):
    """The one-sequence path cuts the gathered K/V at the context length instead of masking:
    lengths at, just past and inside a block edge (a wrong cut would attend to padding)."""
    from pdserve.model.attention import GatherBuffer, _decode_one

    q, k_cache, v_cache, group, tables = decode_inputs([n], heads, kv_heads, seed=n)
    want = reference_decode(q, k_cache, v_cache, tables, [n], [0])
    got = _decode_one(q, k_cache, v_cache, group, GatherBuffer())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_routes_one_sequence_to_its_own_path(monkeypatch):
    import pdserve.model.attention as attention

    calls = []
    monkeypatch.setattr(attention, "_decode_one", lambda q, *a: calls.append("one") or q)
    monkeypatch.setattr(attention, "_decode_sdpa", lambda q, *a: calls.append("sdpa") or q)
    monkeypatch.setattr(attention, "_decode_bags", lambda q, *a: calls.append("bags") or q)
    for lens in ([9], [9, 30]):
        q, k_cache, v_cache, group, _ = decode_inputs(lens, 4, 2, seed=1)
        attention._decode(q, k_cache, v_cache, group, attention.GatherBuffer())
    assert calls == ["one", "sdpa"]  # two sequences: below BAGS_MIN_BATCH, masked SDPA


def test_decode_group_builds_mask_and_slots_only_when_asked():
    (group,) = build_attention_metadata([SeqSlice([3, 8], 20, 1)], BLOCK, "cpu").decodes
    assert group.context_lens == (21,)
    assert "mask" not in vars(group) and "bias" not in vars(group)  # nothing built yet
    assert group.mask.sum().item() == 21 and group.bias.isinf().sum().item() == 32 - 21
    assert group.slots.tolist() == [
        [3 * 16 + i for i in range(16)] + [8 * 16 + i for i in range(16)]
    ]


def test_long_tensor_keeps_its_values():
    import gc

    from pdserve.model.attention import long_tensor

    values = [0, 5, 2**40, 7]
    t = long_tensor(list(values), "cpu")
    gc.collect()  # the list is gone; the tensor must still own its buffer
    assert t.dtype == torch.long and t.tolist() == values
    assert long_tensor([], "cpu").shape == (0,)


def test_decode_bags_serves_batches_of_float32_on_cpu():
    from pdserve.model.attention import BAGS_MIN_BATCH, _bags_apply

    cache = torch.zeros(2, BLOCK, 2, 8)
    q = torch.zeros(BAGS_MIN_BATCH, 4, 8)
    assert _bags_apply(q, cache, cache)
    assert not _bags_apply(q[:1], cache, cache)  # one sequence: SDPA
    assert not _bags_apply(q.bfloat16(), cache.bfloat16(), cache.bfloat16())
    assert not _bags_apply(torch.zeros(BAGS_MIN_BATCH, 16, 8), torch.zeros(2, BLOCK, 8, 8), cache)
