"""Worker-side logic of the connector: owns the transfer agent once vLLM's KV caches exist."""

from __future__ import annotations

import logging

import torch

from pdserve.transfer import messages as m
from pdserve.vllm.agent import Results, TransferAgent
from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.layout import KVLayout
from pdserve.vllm.specs import RecvSpec, ReleaseSpec, SendSpec, WorkerCard

log = logging.getLogger(__name__)


class WorkerSide:
    """Engine-thread facade: hands each step's specs to the agent and collects its results."""

    def __init__(self, cfg: VllmConnectorConfig, engine_id: str, model: str) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.model = model
        self.agent: TransferAgent | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> WorkerCard:
        layout = KVLayout.from_caches(kv_caches)
        t = layout.tensors[0]
        compat = m.Compat(
            model=self.model,
            dtype=str(t.dtype),
            num_layers=len(layout.tensors),
            num_kv_heads=int(t.shape[1]) if t.dim() > 1 else 0,
            head_dim=int(t.shape[-1]),
            block_size=block_size,
            layout=layout.signature(),
        )
        self.agent = TransferAgent(self.cfg, self.engine_id, layout, compat)
        log.info(
            "pdserve connector: %d layers, %d blocks of %d bytes, side channel %s, %s %s",
            len(layout.tensors),
            layout.num_blocks,
            layout.block_nbytes,
            self.agent.side.address,
            self.cfg.transport,
            self.cfg.mode,
        )
        return self.card()

    def card(self) -> WorkerCard:
        assert self.agent is not None
        me = self.agent.me
        return WorkerCard(engine_id=me.engine_id, incarnation=me.incarnation)

    def step(
        self, recvs: list[RecvSpec], sends: list[SendSpec], releases: list[ReleaseSpec]
    ) -> None:
        assert self.agent is not None
        for release in releases:
            self.agent.release(release)
        for spec in sends:
            self.agent.send(spec)
        for spec in recvs:
            self.agent.recv(spec)

    def results(self, finished_req_ids: set[str]) -> Results:
        if self.agent is None:
            return Results()
        self.agent.finished(finished_req_ids)
        return self.agent.take_results()

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
