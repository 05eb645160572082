"""P/D routes of an instance: `GET /kv/info` (identity for routers) and `GET /load`."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Response

from pdserve.engine.async_engine import AsyncEngine
from pdserve.transfer.params import InstanceInfo, InstanceLoad


def kv_routes(async_engine: AsyncEngine) -> APIRouter:
    """Routes reading the engine's connector (None on a monolithic instance)."""
    router = APIRouter()
    engine = async_engine.engine

    @router.get("/kv/info")
    async def kv_info() -> Response:
        c = engine.connector
        info = InstanceInfo(
            engine_id=c.cfg.engine_id if c else "monolithic",
            incarnation=c.cfg.incarnation if c else "",
            role=c.cfg.role if c else "both",
            transfer_mode=c.cfg.mode if c else None,
            transport=c.transport_kind if c else None,
            side_channel_host=c.side.address[0] if c else None,
            side_channel_port=c.side.address[1] if c else None,
            model=engine.model_name,
        )
        return Response(msgspec.json.encode(info), media_type="application/json")

    @router.get("/load")
    async def load() -> Response:
        s = async_engine.stats()
        report = InstanceLoad(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            num_waiting_for_kv=s.num_waiting_for_kv,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
        )
        return Response(msgspec.json.encode(report), media_type="application/json")

    return router
