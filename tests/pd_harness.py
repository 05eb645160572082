"""Drive a prefill and a decode engine in one process, with real connectors and transports.

The router's two flows are replayed by hand (pull: P then D; push: both at once), and
the engines are stepped in turn, so scenarios are deterministic and fast. Real-process
clusters are tested separately (tests/test_pd_e2e.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, TransportConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, RequestOutput, SamplingParams
from pdserve.transfer.connector import ConnectorConfig
from pdserve.transfer.factory import build_factory
from pdserve.transfer.params import KVTransferParams
from tests.procs import free_port


def engine_config(num_blocks: int = 256) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64),
    )


def make_engine(loaded, role: str, mode: str, transport: str = "tcp", num_blocks=256, **kw):
    if role == "both":
        return LLMEngine(loaded, engine_config(num_blocks))
    ccfg = ConnectorConfig(role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}", **kw)
    tcfg = TransportConfig(
        kind=transport,
        timeout_s=kw.get("recv_timeout_s", 5.0),
        cluster_token=kw.get("cluster_token"),
    )
    return LLMEngine(loaded, engine_config(num_blocks), build_factory(ccfg, tcfg))


def greedy_tokens(mono: LLMEngine, ids: list[int], params: SamplingParams) -> list[int]:
    """The tokens a monolithic engine generates for `ids` alone (it must be idle)."""
    mono.add_request(
        EngineRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, params=params)
    )
    tokens: list[int] = []
    while mono.has_work():
        tokens += [t for o in mono.step() for t in o.new_token_ids]
    return tokens


@dataclass
class Pair:
    p: LLMEngine
    d: LLMEngine
    mode: str
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)

    def step(self, only: LLMEngine | None = None) -> None:
        busy = False
        for eng in (self.p, self.d) if only is None else (only,):
            for o in eng.poll_connector():
                self.outputs.setdefault(o.request_id, []).append(o)
            if eng.has_work():
                busy = True
                for o in eng.step():
                    self.outputs.setdefault(o.request_id, []).append(o)
        if not busy:
            time.sleep(0.001)

    def finished(self, rid: str) -> RequestOutput | None:
        outs = self.outputs.get(rid, [])
        return outs[-1] if outs and outs[-1].finished else None

    def run_until(self, cond, timeout: float = 30.0, only: LLMEngine | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError("scenario did not finish")
            self.step(only)

    def submit_p(
        self, rid: str, ids: list[int], tid: str | None = None, sp: SamplingParams | None = None
    ) -> None:
        """P's leg: one greedy token unless `sp` says otherwise (the router sends the
        client's sampling fields with max_tokens=1)."""
        kv = KVTransferParams(do_remote_decode=True, transfer_mode=self.mode, transfer_id=tid)
        sp = sp or SamplingParams(max_tokens=1, temperature=0.0)
        self.p.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=ids, params=sp, kv_transfer=kv)
        )

    def submit_d(self, rid: str, ids: list[int], sp: SamplingParams, kv: KVTransferParams):
        for o in self.d.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=ids, params=sp, kv_transfer=kv)
        ):
            self.outputs.setdefault(o.request_id, []).append(o)

    def push_params(self, tid: str) -> KVTransferParams:
        host, port = self.p.connector.side.address
        return KVTransferParams(
            do_remote_prefill=True,
            transfer_mode="push",
            transfer_id=tid,
            remote_engine_id=self.p.connector.cfg.engine_id,
            remote_host=host,
            remote_port=port,
        )

    def generate(
        self, rid: str, ids: list[int], sp: SamplingParams, p_sp: SamplingParams | None = None
    ) -> RequestOutput:
        """One request through the pair as the router would send it; D's last output."""
        if self.mode == "pull":
            self.submit_p(rid + "-p", ids, sp=p_sp)
            self.run_until(lambda: self.finished(rid + "-p"))
            kv = self.finished(rid + "-p").kv_transfer_params
            params = KVTransferParams(**{**_fields(kv), "do_remote_prefill": True})
            self.submit_d(rid, ids, sp, params)
        else:
            tid = uuid.uuid4().hex
            self.submit_p(rid + "-p", ids, tid, p_sp)
            self.submit_d(rid, ids, sp, self.push_params(tid))
        self.run_until(lambda: self.finished(rid))
        return self.finished(rid)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def settle(self, timeout: float = 10.0) -> None:
        """Run until both sides hold no blocks (leases, quarantines, in-flight) or fail."""
        self.run_until(lambda: self.p.pool.num_used == 0 and self.d.pool.num_used == 0, timeout)
        self.p.check_integrity()
        self.d.check_integrity()

    def close(self) -> None:
        self.p.close()
        self.d.close()


def _fields(params: KVTransferParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def unreachable_push_params(tid: str) -> KVTransferParams:
    """Push params naming a prefill instance at an address nobody answers at."""
    return KVTransferParams(
        do_remote_prefill=True,
        transfer_mode="push",
        transfer_id=tid,
        remote_engine_id="prefill-nobody",
        remote_host="127.0.0.1",
        remote_port=free_port(),
    )
