"""Worker-side logic of the connector: pdserve's transfer cores on vLLM's KV caches.

Once vLLM registered its KV caches (`register`) the worker starts one transfer core per
mode (pdserve.transfer.push.PushConnector on `side_port`, pull.PullConnector on
`pull_side_port`: vLLM's legs pick their mode per request), both over the same
`KVLayout` regions and the same `VllmBlocks` (pdserve.vllm.engine_side), and drives them
from vLLM's worker thread through `VllmTransfers` (pdserve.vllm.transfers). Nothing here
runs a thread of its own: the cores' threads each block on a queue, a socket or a
transfer (none busy-polls).
"""

from __future__ import annotations

import logging
import secrets
from typing import Literal

import torch

from pdserve.config import ConnectorConfig, TransportConfig
from pdserve.transfer import messages as m
from pdserve.transfer.connector import KVConnector
from pdserve.transfer.kv_transport import open_kv_transport
from pdserve.transfer.pull import PullConnector
from pdserve.transfer.push import PushConnector
from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.engine_side import Results, VllmBlocks
from pdserve.vllm.layout import KVLayout
from pdserve.vllm.params import Mode
from pdserve.vllm.specs import StepSpecs, WorkerCard
from pdserve.vllm.transfers import VllmTransfers

log = logging.getLogger(__name__)
Role = Literal["prefill", "decode", "both"]
ROLE_OF_KV_ROLE: dict[str, Role] = {
    "kv_producer": "prefill",
    "kv_consumer": "decode",
    "kv_both": "both",
}


def core_config(
    cfg: VllmConnectorConfig, role: Role, mode: Mode, engine_id: str, incarnation: str
) -> ConnectorConfig:
    """The transfer core's settings from the connector's (one place maps each option)."""
    return ConnectorConfig(
        role=role,
        mode=mode,
        engine_id=engine_id,
        incarnation=incarnation,
        side_host=cfg.side_host,
        side_port=cfg.side_port if mode == "push" else cfg.pull_side_port,
        side_advertise_host=cfg.advertise_host,
        cluster_token=cfg.cluster_token(),
        lease_s=cfg.lease_s,
        recv_timeout_s=cfg.recv_timeout_s,
        handshake_timeout_s=cfg.handshake_timeout_s,
        heartbeat_s=cfg.heartbeat_s,
        heartbeat_misses=cfg.heartbeat_misses,
        push_layerwise=cfg.push_layerwise,
        # P's scheduler announces a prompt as it enters vLLM's queue (`on_new_request`): a
        # registration waits this long for that, or for its prompt's end once it is gone.
        registration_ttl_s=cfg.registration_grace_s,
        unknown_transfer_grace_s=cfg.registration_grace_s,
    )


def transport_config(cfg: VllmConnectorConfig, mode: Mode) -> TransportConfig:
    return TransportConfig(
        kind=cfg.transport,
        host=cfg.side_host,
        port=cfg.transport_port if mode == "push" else cfg.pull_transport_port,
        advertise_host=cfg.advertise_host,
        cluster_token=cfg.cluster_token(),
        timeout_s=cfg.transfer_timeout_s,
    )


class WorkerSide:
    """Engine-thread facade over the transfer cores (see the module docstring)."""

    def __init__(self, cfg: VllmConnectorConfig, engine_id: str, model: str, role: Role) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.model = model
        self.role = role
        self.incarnation = secrets.token_hex(6)
        self.transfers: VllmTransfers | None = None
        self._cores: dict[Mode, KVConnector] = {}

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
        blocks = VllmBlocks()
        for mode in ("push", "pull"):
            self._cores[mode] = self._core(mode, layout, blocks, compat)
        self.transfers = VllmTransfers(self._cores, blocks, layout.names)
        log.info(
            "pdserve connector: %d layers, %d blocks of %d bytes, side channels %s (push) "
            "and %s (pull), %s, default mode %s",
            len(layout.tensors),
            layout.num_blocks,
            layout.block_nbytes,
            self._cores["push"].side_address,
            self._cores["pull"].side_address,
            self.cfg.transport,
            self.cfg.mode,
        )
        return self.card()

    def _core(
        self, mode: Mode, layout: KVLayout, blocks: VllmBlocks, compat: m.Compat
    ) -> KVConnector:
        ccfg = core_config(self.cfg, self.role, mode, self.engine_id, self.incarnation)
        # One transport per core, each with its own identity in its peers' transports.
        name = self.engine_id if mode == "push" else f"{self.engine_id}-pull"
        transport = open_kv_transport(transport_config(self.cfg, mode), name, layout)
        cls = PushConnector if mode == "push" else PullConnector
        return cls(ccfg, layout, blocks, compat, transport)

    def card(self) -> WorkerCard:
        return WorkerCard(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            push_port=self._cores["push"].side_address[1],
            pull_port=self._cores["pull"].side_address[1],
        )

    def step(self, specs: StepSpecs) -> None:
        assert self.transfers is not None
        self.transfers.step(specs)

    def save_layer(self, layer_name: str, specs: StepSpecs) -> None:
        if self.transfers is not None:
            self.transfers.save_layer(layer_name, specs)

    def end_step(self) -> None:
        if self.transfers is not None:
            self.transfers.end_step()

    def results(self, finished_req_ids: set[str]) -> Results:
        if self.transfers is None:
            return Results()
        return self.transfers.results(finished_req_ids)

    def close(self) -> None:
        if self.transfers is None:
            return
        for mode, core in self._cores.items():
            st, w = core.metrics().stats, core.metrics().writer
            log.info(
                "pdserve connector (%s): %d transfers, %d received, %d failures%s",
                mode,
                st.transfers,
                st.received,
                st.failures,
                f", {w.layerwise} written layer by layer" if w is not None else "",
            )
        self.transfers.close()
        self.transfers = None
