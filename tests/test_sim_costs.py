"""Roofline costs on hand-computed cases, transfer and descriptor arithmetic, profiles."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.sim import costs
from pdserve.sim.costs import CostModel, SeqWork
from pdserve.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    SoftwareProfile,
    builtin_names,
    load_hardware,
    load_model,
    load_software,
    with_overrides,
)

# A model small enough to count by hand: 2 layers, hidden 4, 2 query heads of 2 dims, one KV
# head, MLP 8, vocab 10, untied, float16 (2 bytes).
MODEL = ModelProfile(
    name="hand",
    num_layers=2,
    hidden_size=4,
    intermediate_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    vocab_size=10,
    num_params=1000,
    dtype="float16",
)
HW = HardwareProfile(
    name="hand-hw",
    peak_flops=1000.0,
    mem_bw=100.0,
    mem_capacity=1e6,
    devices_per_node=8,
    flops_efficiency=0.5,
    mem_bw_efficiency=0.25,
    allreduce_bw=50.0,
    allreduce_latency_s=0.001,
    net_bw_per_device=10.0,
    net_latency_s=0.002,
)
SW = SoftwareProfile(
    name="hand-sw",
    block_size=4,
    step_overhead_s=0.01,
    seq_overhead_s=0.001,
    per_descriptor_s=0.5,
    post_fixed_s=3.0,
    blocks_per_descriptor=1,
)


def test_layer_params_and_kv_bytes_by_hand() -> None:
    # q 4x4, k 4x2, v 4x2, o 4x4 = 48; MLP 3 x 4 x 8 = 96
    assert costs.layer_linear_params(MODEL) == 144
    # K and V x 2 layers x 1 head x 2 dims x 2 bytes
    assert costs.kv_bytes_per_token(MODEL) == 16
    # untied: the 10 x 4 input embedding is gathered, not read
    assert costs.weight_bytes_per_step(MODEL) == (1000 - 40) * 2


def test_step_flops_and_bytes_by_hand() -> None:
    seqs = [SeqWork(3, 5, True), SeqWork(1, 7, True), SeqWork(2, 0, False)]
    tokens, sampled = 6, 2
    pairs = (3 * 5 + 6) + (1 * 7 + 1) + (0 + 3)  # n*c + n(n+1)/2
    expected = 2 * tokens * 2 * 144 + 2 * sampled * 10 * 4 + 4 * 2 * 2 * 2 * pairs
    assert costs.step_flops(MODEL, seqs) == expected
    kv_tokens = (5 + 6) + (7 + 2) + (0 + 4)  # cached read + new written twice (read, write)
    assert costs.step_bytes(MODEL, seqs) == 1920 + kv_tokens * 16


def test_step_time_is_the_roofline_plus_allreduce_and_overheads() -> None:
    seqs = [SeqWork(3, 5, True), SeqWork(1, 7, True)]
    flops = costs.step_flops(MODEL, seqs)
    nbytes = costs.step_bytes(MODEL, seqs)
    tp = 2
    cost = CostModel(MODEL, HW, SW, tp=tp).step(seqs)
    assert cost.compute == flops / (tp * 1000.0 * 0.5)
    assert cost.memory == nbytes / (tp * 100.0 * 0.25)
    ring = 2 * (tp - 1) / tp * (4 * 4 * 2) / 50.0  # 4 tokens x hidden 4 x 2 bytes
    assert cost.allreduce == pytest.approx(2 * 2 * (0.001 + ring), rel=1e-15)
    assert cost.overhead == 0.01 + 2 * 0.001
    assert cost.total == max(cost.compute, cost.memory) + cost.allreduce + cost.overhead
    assert CostModel(MODEL, HW, SW, tp=1).step(seqs).allreduce == 0.0
    assert CostModel(MODEL, HW, SW).step([]).total == 0.0


def test_transfer_time_is_bytes_over_bandwidth_plus_latency() -> None:
    model = CostModel(MODEL, HW, SW, tp=4)
    assert model.transfer_time(800.0) == 800.0 / (4 * 10.0) + 0.002
    assert model.kv_bytes(10) == 160.0
    assert model.kv_bytes(10, num_layers=1) == 80.0


def test_descriptors_per_block_and_coalesced() -> None:
    model = CostModel(MODEL, HW, SW)
    # 10 tokens = 3 blocks of 4; K and V of 2 layers
    assert model.descriptors(10) == 2 * 2 * 3
    assert model.descriptors(10, num_layers=1) == 2 * 1 * 3
    assert model.post_time(10) == 3.0 + 0.5 * 12
    coalesced = CostModel(MODEL, HW, msgspec.structs.replace(SW, blocks_per_descriptor=1000))
    assert coalesced.descriptors(10) == 4


def test_kv_capacity_subtracts_the_weights() -> None:
    model = CostModel(MODEL, HW, SW, tp=2)
    free = 2 * 1e6 * 0.9 - (1000 - 40) * 2 - 40 * 2
    assert model.kv_capacity_tokens() == int(free // 16)


def test_builtin_profiles_load_and_match_their_shapes() -> None:
    for name in builtin_names("models"):
        m = load_model(name)
        tied = 1 if m.tie_word_embeddings else 2
        norms = 2 * m.hidden_size + 2 * m.head_dim
        counted = m.num_layers * (costs.layer_linear_params(m) + norms)
        counted += tied * m.vocab_size * m.hidden_size + m.hidden_size
        assert counted == m.num_params, name
    for name in builtin_names("hardware"):
        assert load_hardware(name).peak_flops > 0
    for name in builtin_names("software"):
        assert load_software(name).block_size >= 1


def test_qwen3_32b_profile_matches_the_model_card() -> None:
    m = load_model("qwen3-32b")
    assert costs.kv_bytes_per_token(m) == 256 * 1024
    assert round(m.num_params / 1e8) == 328


def test_unknown_profile_and_field_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="no models profile"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="unknown field"):
        with_overrides(SW, {"no_such_field": "1"})
    path = tmp_path / "m.json"
    path.write_bytes(msgspec.json.encode(MODEL))
    assert load_model(str(path)) == MODEL
    assert with_overrides(SW, {"per_descriptor_s": "2e-6"}).per_descriptor_s == 2e-6
    assert with_overrides(SW, {"pull_setup": "thread"}).pull_setup == "thread"
