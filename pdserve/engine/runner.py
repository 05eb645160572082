"""Model runner: turns a scheduled step into tensors, runs the model, samples.

Reads the KV cache and the requests' block tables; owns no blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.kv.cache import KVCache
from pdserve.model.attention import (
    AttentionMetadata,
    SeqSlice,
    build_attention_metadata,
    long_tensor,
)
from pdserve.model.decoder import Decoder


class ModelRunner:
    """Runs one forward pass per engine step on `model` with `kv`."""

    def __init__(self, model: Decoder, kv: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[ScheduledSeq],
        on_layer_done: Callable[[int], None] | None = None,
    ) -> dict[str, int]:
        """Forward `seqs`; returns the sampled token for each sequence that samples."""
        ids: list[int] = []
        for s in seqs:
            ids += s.request.token_ids(s.num_computed, s.num_computed + s.num_new)
        slices = [SeqSlice(s.request.block_ids, s.num_computed, s.num_new) for s in seqs]
        meta = build_attention_metadata(slices, self.kv.block_size, self.device)
        input_ids = long_tensor(ids, self.device)
        hidden = self.model(input_ids, meta.positions, meta, self.kv, on_layer_done=on_layer_done)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        if not rows:
            return {}
        logits = self.model.compute_logits(_rows_to_sample(hidden, meta, rows))
        reqs = [seqs[i].request for i in rows]
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, tokens, strict=True)}


def _rows_to_sample(hidden: torch.Tensor, meta: AttentionMetadata, rows: list[int]) -> torch.Tensor:
    """The hidden states of the last new token of the sequences `rows` (indices into the
    step's sequences). A decode-only step where every sequence samples needs no gather."""
    if len(rows) == meta.num_tokens:  # one token per sequence, all sampling: all of hidden
        return hidden
    return hidden[meta.logits_indices[rows]]
