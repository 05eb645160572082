"""Profiles: the model, the hardware and the serving software, as JSON data files.

A simulation is fully described by four things: a model profile (shapes and parameter
count), a hardware profile (per-device peak FLOP/s and memory bandwidth, the devices' links
inside a node and between nodes, each at a stated efficiency), a software profile (the
serving stack's scheduler limits and the overheads of its protocol steps: HTTP hops,
descriptor posting, where the transfer setup runs) and the tensor-parallel size. The first
three are JSON files; built-in ones live under `pdserve/sim/profiles/{models,hardware,
software}/NAME.json`, and a path to any JSON file of the same shape works too.

Every field is a physical quantity or a named overhead; each file's `notes` says where its
numbers come from. Profiles are immutable once loaded (frozen msgspec Structs); what-if
changes go through `with_overrides`, which returns new profiles.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
Placement = Literal["engine_loop", "thread"]


class ModelProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A decoder-only transformer's shapes (Hugging Face config names) and its size.

    `num_params` is the published total (embeddings included); weight bytes read per step
    come from it. FLOPs come from the shapes (see `costs`).
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_params: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    notes: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model dtype {self.dtype!r} not in {sorted(DTYPE_BYTES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


class HardwareProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One accelerator (or CPU core) type and the links around it. Per device unless named.

    `peak_flops` is dense FLOP/s in the model's dtype; `flops_efficiency` and
    `mem_bw_efficiency` are the achieved fractions the roofline uses. The all-reduce link
    joins the devices of one tensor-parallel group; the network link (`net_bw_per_device`,
    one-way bytes/s per device, and `net_latency_s`) carries KV between instances. Each
    device of a TP group moves its own shard of the KV over its own share of the network.
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_capacity: float
    devices_per_node: int
    flops_efficiency: float
    mem_bw_efficiency: float
    allreduce_bw: float = 0.0
    allreduce_latency_s: float = 0.0
    net_bw_per_device: float
    net_latency_s: float
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("flops_efficiency", "mem_bw_efficiency"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]")
        if min(self.peak_flops, self.mem_bw, self.net_bw_per_device) <= 0:
            raise ValueError("peak_flops, mem_bw and net_bw_per_device must be > 0")


class SoftwareProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The serving stack: scheduler limits and the cost and placement of each protocol step.

    Engine: `step_overhead_s` (host work per engine step: scheduling, input preparation,
    sampling launch) and `seq_overhead_s` (the same per scheduled sequence).
    Protocol: `http_hop_s` (one HTTP hop: client->router, router->instance, response back);
    `api_overhead_s` (an instance's front end per request: parse, tokenize);
    `handshake_s` (first contact of a P-D pair, paid by the first request unless warm-ups
    ran); `notify_s` (a side-channel message or transport notification);
    descriptors: one per (layer, K or V, run of `blocks_per_descriptor` blocks) on each TP
    rank (1: one per block, vLLM's NixlConnector; a large value: one per contiguous region,
    pdserve's coalescing of a fresh pool), costing `per_descriptor_s` each plus
    `post_fixed_s` per post, the ranks working in parallel;
    `pull_setup` where D builds and posts the READ ("engine_loop": D's engine step waits for
    it, stalling every decoding request; "thread": a reader thread); `push_writer` where P's
    writer work runs ("thread": its own core; "engine_loop": between P's steps, as with a
    Python thread that needs the engine's core and GIL); `push_handoff_next_step`: P hands
    finished blocks to the writer only at the next step boundary (vLLM's step metadata);
    `layerwise_push`: stream each layer's KV as soon as its forward pass is done;
    `first_token_from_prefill`: D emits P's sampled token when the KV lands (pdserve) rather
    than recomputing the last prompt token in a step (vLLM);
    `remote_headroom_fraction`: D admits a prompt whose KV comes from P only while it leaves
    this fraction of its pool (and one block per running request) free, pdserve's guard
    against a push backlog on P filling D's pool (0: no guard).
    """

    name: str
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_memory_fraction: float = 0.9
    step_overhead_s: float = 0.0
    seq_overhead_s: float = 0.0
    http_hop_s: float = 0.0
    api_overhead_s: float = 0.0
    handshake_s: float = 0.0
    notify_s: float = 0.0
    blocks_per_descriptor: int = 1
    per_descriptor_s: float = 0.0
    post_fixed_s: float = 0.0
    pull_setup: Placement = "engine_loop"
    push_writer: Placement = "thread"
    push_handoff_next_step: bool = False
    layerwise_push: bool = True
    first_token_from_prefill: bool = False
    remote_headroom_fraction: float = 0.0
    notes: str = ""

    def __post_init__(self) -> None:
        limits = (self.block_size, self.max_num_batched_tokens, self.max_num_seqs)
        if min(limits) < 1 or self.blocks_per_descriptor < 1:
            raise ValueError(
                "block_size, max_num_batched_tokens, max_num_seqs, blocks_per_descriptor "
                "must be >= 1"
            )


Kind = Literal["models", "hardware", "software"]
_TYPES: dict[str, type] = {
    "models": ModelProfile,
    "hardware": HardwareProfile,
    "software": SoftwareProfile,
}


def builtin_names(kind: Kind) -> list[str]:
    """Names of the profiles shipped with pdserve for `kind`."""
    folder = resources.files("pdserve.sim") / "profiles" / kind
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def _read(kind: Kind, name_or_path: str) -> bytes:
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return path.read_bytes()
    entry = resources.files("pdserve.sim") / "profiles" / kind / f"{name_or_path}.json"
    if not entry.is_file():
        known = ", ".join(builtin_names(kind))
        raise ValueError(f"no {kind} profile {name_or_path!r} (built in: {known}; or a .json)")
    return entry.read_bytes()


def load_profile(kind: Kind, name_or_path: str) -> msgspec.Struct:
    """A built-in profile by name, or any JSON file of that kind by path."""
    try:
        return msgspec.json.decode(_read(kind, name_or_path), type=_TYPES[kind])
    except msgspec.ValidationError as exc:
        raise ValueError(f"{kind} profile {name_or_path!r}: {exc}") from None


def load_model(name_or_path: str) -> ModelProfile:
    """Model profile `name_or_path` (e.g. "qwen3-32b", "builtin-small")."""
    return load_profile("models", name_or_path)


def load_hardware(name_or_path: str) -> HardwareProfile:
    """Hardware profile `name_or_path` (e.g. "h200-p5en")."""
    return load_profile("hardware", name_or_path)


def load_software(name_or_path: str) -> SoftwareProfile:
    """Software profile `name_or_path` (e.g. "vllm-gpu", "pdserve-cpu")."""
    return load_profile("software", name_or_path)


def with_overrides(profile: msgspec.Struct, items: dict[str, str]) -> msgspec.Struct:
    """A copy of `profile` with fields replaced from strings (decoded as JSON when they
    parse, else kept as strings); unknown fields raise ValueError."""
    if not items:
        return profile
    known = set(profile.__struct_fields__)
    if bad := sorted(set(items) - known):
        raise ValueError(f"unknown field(s) {bad} for {type(profile).__name__}")
    raw = msgspec.to_builtins(profile)
    for key, text in items.items():
        try:
            raw[key] = msgspec.json.decode(text)
        except msgspec.DecodeError:
            raw[key] = text
    return msgspec.convert(raw, type=type(profile))
