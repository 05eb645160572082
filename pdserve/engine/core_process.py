"""The engine core process (`pdserve serve --engine-process`): the engine loop with its own
interpreter, so the HTTP front end never holds the GIL the engine needs.

    python -m pdserve.engine.core_process    (a `CoreSpec` on stdin; started by
                                              pdserve.engine.core_client, never by hand)

Ownership: this process owns the engine, its scheduler, the KV cache, every KV block and the
connector (side channel, transport, writer threads). The front end owns the HTTP side and
its requests' streams; it only sends `Add`/`Abort`/`Release`/`Stop` and reads `Step`s.

The engine loop (pdserve.engine.loop, the same as in-thread) runs on the main thread with
`Core` as its side: commands are the ZMQ messages, a connector wake-up writes a pipe the
poller watches, and every output is sent as soon as the loop hands it over. A `Snapshot`
rides along at most every `SNAPSHOT_S` while busy, and whenever the engine goes idle with a
state the front end has not seen.

The core exits when told to (`Stop`), on SIGTERM, or when its front end is gone (it asks the
kernel for SIGTERM on the parent's death and also checks its parent pid), aborting what runs.
SIGINT is ignored: a Ctrl-C reaches the front end too, which stops the core in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import zmq

from pdserve.engine.commands import Command, Stop
from pdserve.engine.core_protocol import Codec, CoreSpec, Ready, Snapshot, StartFailed, Step
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.types import RequestOutput
from pdserve.ports import EXIT_ADDRESS_IN_USE, is_address_in_use

log = logging.getLogger("pdserve.core")

SNAPSHOT_S = 0.02  # the most a busy engine's snapshot lags (load reports, /metrics, gate)
IDLE_POLL_MS = 500  # an idle core still checks its parent this often
_PR_SET_PDEATHSIG = 1


def main() -> int:
    """Build the engine described on stdin, then serve its front end until stopped."""
    codec = Codec()
    spec = codec.spec.decode(sys.stdin.buffer.read())
    logging.basicConfig(
        level=spec.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parent = os.getppid()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, 2000)  # the last Step must reach the front end
    inbox.connect(spec.to_core)
    outbox.connect(spec.from_core)
    try:
        engine = _build(spec, outbox, codec)
        if isinstance(engine, int):
            return engine
        core = Core(engine, inbox, outbox, codec, parent)
        outbox.send(codec.encode(Ready(info=engine.info(), snapshot=core.snapshot())))
        core.run()
        return 0
    finally:
        inbox.close()
        outbox.close()
        ctx.term()


def _build(spec: CoreSpec, outbox: zmq.Socket, codec: Codec) -> LLMEngine | int:
    """The engine, or the exit status after telling the front end why not (`StartFailed`)."""
    from pdserve.transfer.factory import build_factory
    from pdserve.transfer.transport import BackendUnavailableError

    factory = None
    if spec.connector is not None and spec.transport is not None:
        factory = build_factory(spec.connector, spec.transport)
    try:
        return LLMEngine.from_config(spec.engine, factory)
    except (BackendUnavailableError, OSError, ValueError) as exc:
        # The statuses `pdserve serve` gives the same failures in-thread.
        status = 1 if isinstance(exc, OSError) else 2
        status = EXIT_ADDRESS_IN_USE if is_address_in_use(exc) else status
        log.error("%s", exc)
        outbox.send(codec.encode(StartFailed(error=str(exc), status=status)))
        return status


class Core:
    """An engine core process's side of the engine loop (module doc)."""

    def __init__(
        self,
        engine: LLMEngine,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
        codec: Codec,
        parent: int,
    ) -> None:
        self.engine = engine
        self.inbox, self.outbox, self.codec = inbox, outbox, codec
        self.parent = parent
        self.stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._loop = EngineLoop(engine, self)
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._last_snapshot: Snapshot | None = None
        self._snapshot_at = 0.0
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def run(self) -> None:
        """Serve until `Stop`, SIGTERM or the front end's death; then abort what runs."""
        try:
            self._loop.run()
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- the engine loop's side (LoopIO; the main thread calls all but `wake`) -------------
    def running(self) -> bool:
        return not self.stopping and os.getppid() == self.parent

    def receive(self, block: bool) -> list[Command]:
        """The messages that came; when `block`, waits up to `IDLE_POLL_MS` for one (or a
        wake-up) first."""
        self._wait(IDLE_POLL_MS if block else 0)
        commands: list[Command] = []
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return commands
            commands.append(self.codec.to_core.decode(raw))
            if isinstance(commands[-1], Stop):
                self.stopping = True
                return commands

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._send(outputs)

    def handoff(self, outputs: list[RequestOutput]) -> None:
        self._send(outputs)  # mid-step handoffs leave at once

    def stepped(self, outputs: list[RequestOutput]) -> None:
        self._send(outputs, with_snapshot=self._snapshot_due())

    def idle(self) -> None:
        if self._changed():
            self._send([], with_snapshot=True)

    def finish(self, error: BaseException | None) -> None:
        outputs: list[RequestOutput] = []
        for rid in list(self.engine.requests):
            outputs += self.engine.abort_request(rid)
        self._send(outputs, with_snapshot=True)

    def _wait(self, timeout_ms: int) -> None:
        for fd, _ in self._poller.poll(timeout_ms):
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass

    # -- sending -------------------------------------------------------------------------
    def _send(self, outputs: list[RequestOutput], with_snapshot: bool = False) -> None:
        if not outputs and not with_snapshot:
            return
        snap = self.snapshot() if with_snapshot else None
        if snap is not None:
            self._last_snapshot, self._snapshot_at = snap, time.monotonic()
        self.outbox.send(self.codec.encode(Step(outputs=outputs, snapshot=snap)))

    def _snapshot_due(self) -> bool:
        return not self.engine.has_work() or time.monotonic() - self._snapshot_at >= SNAPSHOT_S

    def _changed(self) -> bool:
        """Idle: whether the state differs from the last snapshot sent (a lease expired,
        a hold was released) — checked at most every `IDLE_POLL_MS` or wake-up."""
        return self.snapshot() != self._last_snapshot

    def snapshot(self) -> Snapshot:
        """The live state the front end reads (pdserve.engine.handle)."""
        c = self.engine.connector
        in_use = c.transfers_in_use() if c is not None else []
        return Snapshot(
            stats=self.engine.stats(),
            live=self.engine.live_requests(),
            transfers_in_use=in_use,
            peers=c.peer_sizes() if c is not None else {},
            connector=c.metrics() if c is not None else None,
        )

    # -- signals and wake-ups (any thread) -------------------------------------------------
    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop anyway
            os.write(self._wake_w, b"\0")

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stopping = True
        self.wake()


def _die_with_parent() -> None:
    """Ask Linux for SIGTERM when the front end dies (elsewhere the parent-pid check in the
    loop notices it within `IDLE_POLL_MS`)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
