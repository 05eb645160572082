"""Builds an instance's KV connector from its configs: role, mode, transport.

`pdserve serve` builds the `ConnectorConfig` and `TransportConfig` from its flags
(pdserve.server.serve_args) and hands `build_factory(...)` to the engine, which calls it
once the KV cache exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.config import ConnectorConfig, TransportConfig
from pdserve.transfer.messages import Compat

if TYPE_CHECKING:
    from pdserve.kv.cache import KVCache
    from pdserve.model.loader import LoadedModel
    from pdserve.transfer.adapter import EngineSide
    from pdserve.transfer.connector import KVConnector


def compat_of(kv: KVCache, loaded: LoadedModel) -> Compat:
    return Compat(
        model=loaded.name,
        dtype=str(kv.dtype).removeprefix("torch."),
        num_layers=kv.num_layers,
        num_kv_heads=kv.num_kv_heads,
        head_dim=kv.head_dim,
        block_size=kv.block_size,
        layout="LKBTHD",  # [layers, k|v, blocks, tokens, heads, head_dim]
    )


def build_factory(ccfg: ConnectorConfig, tcfg: TransportConfig):
    """The engine's connector factory for a P/D role (`ccfg.mode` picks pull or push)."""

    def factory(kv: KVCache, engine: EngineSide, loaded: LoadedModel) -> KVConnector:
        from pdserve.transfer.descriptors import OneRegion
        from pdserve.transfer.kv_transport import open_kv_transport
        from pdserve.transfer.pull import PullConnector
        from pdserve.transfer.push import PushConnector

        regions = OneRegion.of(kv)
        transport = open_kv_transport(
            tcfg, ccfg.engine_id, regions, ccfg.faults.fail_transfer_every
        )
        cls = PushConnector if ccfg.mode == "push" else PullConnector
        return cls(ccfg, regions, engine, compat_of(kv, loaded), transport)

    return factory
