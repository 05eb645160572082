"""The engine loop, one implementation for both ways an instance runs its engine: in a thread
of the HTTP process (pdserve.engine.async_engine) and as an engine core process
(pdserve.engine.core_process). Each gives the loop its side, a `LoopIO`: where commands come
from and where outputs go.

One pass: take the commands that came (waiting for one, or for a connector wake-up, only
while the engine has no work) and apply them; hand over at once what the connector finished
(KV arrived, a failed transfer, a prefill leg's answer); run one step if there is work and
hand over its outputs, else tell the side the engine is idle. Outputs made between two layers
of a step (`LLMEngine.early_outputs`) are handoffs too, handed over as soon as they exist.

Ownership: the thread that runs `EngineLoop.run` owns the engine, its scheduler, its KV
blocks and every request until the loop ends; other threads reach it only through the side's
command queue and `wake`. When the loop ends (stopped, or the engine raised), the side ends
every request still running (`LoopIO.finish`) and then the engine is closed.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.commands import Abort, Add, Command, Release, Stop
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import RequestOutput
from pdserve.tracelog import hop


class LoopIO(Protocol):
    """The front-end side of an engine loop (the loop's thread calls all but `wake`)."""

    def running(self) -> bool:
        """False once the loop should end (checked before every pass)."""
        ...

    def receive(self, block: bool) -> list[Command]:
        """The commands that came, in order; with `block`, waits a while for one (or a
        `wake`) first."""
        ...

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Outputs of applied commands (an add refused, an abort)."""
        ...

    def handoff(self, outputs: list[RequestOutput]) -> None:
        """Outputs of the connector's events and of mid-step handoffs: due at once."""
        ...

    def stepped(self, outputs: list[RequestOutput]) -> None:
        """The outputs of one step."""
        ...

    def idle(self) -> None:
        """A pass found no work."""
        ...

    def wake(self) -> None:
        """Any thread (the connector's): end a blocking `receive` now."""
        ...

    def finish(self, error: BaseException | None) -> None:
        """The loop ends (`error`: what the engine raised): end what still runs."""
        ...


class EngineLoop:
    """Runs `engine` for `io` (module doc). Built before the loop's thread starts: it wires
    the connector's wake-ups and the engine's mid-step handoffs to `io`."""

    def __init__(self, engine: LLMEngine, io: LoopIO) -> None:
        self.engine, self.io = engine, io
        if engine.connector is not None:
            engine.connector.wake = io.wake
        engine.early_outputs = io.handoff  # called on the loop's thread, mid-step

    def run(self) -> None:
        """Serve until `io.running()` is false or a `Stop` comes; re-raises what the engine
        raised after `io.finish`. Closes the engine either way."""
        engine, io = self.engine, self.io
        error: BaseException | None = None
        try:
            while io.running():
                outputs, stop = self._apply(io.receive(block=not engine.has_work()))
                if outputs:
                    io.deliver(outputs)
                if stop:
                    break
                events = engine.poll_connector()
                if events:
                    io.handoff(events)
                if engine.has_work():
                    io.stepped(engine.step())
                else:
                    io.idle()
        except BaseException as exc:  # a dead engine must not look alive
            error = exc
            raise
        finally:
            try:
                io.finish(error)
            finally:
                engine.close()

    def _apply(self, commands: list[Command]) -> tuple[list[RequestOutput], bool]:
        """Apply `commands` in order up to a `Stop`; (their outputs, whether one came)."""
        outputs: list[RequestOutput] = []
        for cmd in commands:
            if isinstance(cmd, Add):
                hop(cmd.request.request_id, "d.engine_add")
                outputs += self.engine.add_request(cmd.request)
            elif isinstance(cmd, Abort):
                outputs += self.engine.abort_request(cmd.request_id)
            elif isinstance(cmd, Release):
                self.engine.release_transfer(cmd.transfer_id)
            elif isinstance(cmd, Stop):
                return outputs, True
        return outputs, False
