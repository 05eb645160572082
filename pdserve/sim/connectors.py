"""The protocol steps of each mode, played on the simulated instances.

Monolithic: router -> instance; the instance prefills and decodes.

Pull (the NIXL connector design):
  client -> router -> P (prefill, max_tokens=1) -> P's response -> router -> D.
  D admits the request at a step boundary (blocks reserved), handshakes with P on first
  contact, builds and posts the READ's descriptors (in D's engine loop, stalling every
  decoding request, or on a reader thread, per the software profile), the data crosses the
  P->D link, and D sees the completion at its next step boundary; P frees its hold when
  D's done-notification arrives.
Push (pdserve's and vLLM's NixlPushConnector design):
  the router sends both legs at once. D admits at a step boundary and its sender thread
  sends the registration to P (after a handshake on first contact). P's writer pairs the
  registration with the computed KV in either order. With layer-wise streaming, every
  layer of every prompt chunk whose forward pass starts after the registration arrived is
  posted as soon as that layer is done; KV computed before the registration is posted
  when it arrives. Without it, the whole prompt is posted once prefill ends (and the
  writer gets it, with `push_handoff_next_step`, only at P's next step boundary). The
  WRITE's notification follows the last byte; D's poller hands the request to the engine
  at its next boundary; P frees its hold when the write completes.
On D the first token is either P's sampled token, emitted as soon as the KV is in place
(`first_token_from_prefill`), or the result of one decode-side step over the last prompt
token (vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.sim.cluster_view import ClusterView
from pdserve.sim.engine import FifoServer
from pdserve.sim.instance import Instance, Seq, SimRequest


class Connector:
    """Shared by the modes: the router's hops and the client's view of tokens."""

    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster
        self.loop = cluster.loop
        self.sw = cluster.cfg.software
        # Router -> instance: the client's hop, the router's hop, the front end's work
        # (one hop less each way when the client talks to a monolithic instance directly).
        direct = cluster.cfg.mode == "monolithic" and not cluster.cfg.monolithic_router
        self.hops = 1 if direct else 2
        self.leg_delay = self.hops * self.sw.http_hop_s + self.sw.api_overhead_s

    def dispatch(self, req: SimRequest, now: float) -> None:
        raise NotImplementedError

    def _send_leg(self, inst: Instance, seq: Seq, at: float) -> None:
        self.loop.at(at, inst.deliver, inst.add, seq)

    def _decode_seq(self, req: SimRequest, inst: Instance, remote: bool) -> Seq:
        if not remote:
            blocks = inst.blocks_for(req.prompt_len + req.output_len)
            return Seq(req, req.prompt_len, 0, req.output_len, blocks)
        recompute = 0 if self.sw.first_token_from_prefill else 1
        blocks = inst.blocks_for(req.prompt_len + req.output_len)
        return Seq(req, recompute, req.prompt_len - recompute, req.output_len, blocks, True)

    def _prefill_seq(self, req: SimRequest, inst: Instance) -> Seq:
        return Seq(req, req.prompt_len, 0, 0, inst.blocks_for(req.prompt_len))

    # --- Listener -------------------------------------------------------------------

    def on_remote_admit(self, inst: Instance, seq: Seq, now: float) -> None:
        return None

    def on_forward(
        self, inst: Instance, seq: Seq, num_new: int, start: float, duration: float
    ) -> None:
        return None

    def on_prefill_done(self, inst: Instance, seq: Seq, now: float) -> None:
        return None

    def on_token(self, inst: Instance, seq: Seq, now: float) -> None:
        req = seq.req
        req.token_times.append(now + self.hops * self.sw.http_hop_s)
        if req.done:
            self.loop.at(req.token_times[-1], self.cluster.on_done, req)


class MonoConnector(Connector):
    """No transfer: one instance does both phases."""

    def dispatch(self, req: SimRequest, now: float) -> None:
        inst = self.cluster.pick_prefill.pick()
        self._send_leg(inst, self._decode_seq(req, inst, remote=False), now + self.leg_delay)


@dataclass(eq=False)
class _PullState:
    p: Instance
    p_seq: Seq


class PullConnector(Connector):
    """P answers with block ids; the router relays them to D, which READs."""

    def __init__(self, cluster: ClusterView) -> None:
        super().__init__(cluster)
        self.state: dict[int, _PullState] = {}
        self.readers: dict[str, FifoServer] = {}

    def dispatch(self, req: SimRequest, now: float) -> None:
        p = self.cluster.pick_prefill.pick()
        p_seq = self._prefill_seq(req, p)
        self.state[req.index] = _PullState(p, p_seq)
        self._send_leg(p, p_seq, now + self.leg_delay)

    def on_prefill_done(self, inst: Instance, seq: Seq, now: float) -> None:
        seq.req.prefill_done = now
        d = self.cluster.pick_decode.pick()
        # P's response hop to the router, the router's hop to D, D's front end.
        self._send_leg(d, self._decode_seq(seq.req, d, remote=True), now + self.leg_delay)

    def on_remote_admit(self, inst: Instance, seq: Seq, now: float) -> None:
        st = self.state[seq.req.index]
        ready = self.cluster.pair_ready(st.p, inst, now)
        setup = self.cluster.decode_costs.post_time(seq.req.prompt_len)
        if self.sw.pull_setup == "thread":
            _, end = self.readers.setdefault(inst.name, FifoServer()).reserve(ready, setup)
            self._read(inst, seq, end)
        elif ready <= now:
            inst.add_loop_work(setup, lambda t: self._read(inst, seq, t))
        else:
            work = (setup, lambda t: self._read(inst, seq, t))
            self.loop.at(ready, inst.deliver, inst.add_loop_work, *work)

    def _read(self, d: Instance, seq: Seq, posted: float) -> None:
        st = self.state.pop(seq.req.index)
        num_bytes = self.cluster.prefill_costs.kv_bytes(seq.req.prompt_len)
        _, end = self.cluster.link(st.p, d).reserve(posted, self.cluster.wire_time(num_bytes))
        landed = end + self.cluster.cfg.hardware.net_latency_s
        self.loop.at(landed + self.sw.notify_s, d.deliver, d.kv_arrived, seq)
        self.loop.at(landed + self.sw.notify_s, st.p.release, st.p_seq.blocks)


@dataclass(eq=False)
class _PushXfer:
    """One transfer's progress on P's writer. Units of `posted`: token-layers."""

    req: SimRequest
    p: Instance
    d: Instance
    p_seq: Seq
    d_seq: Seq
    registered: bool = False
    handed: bool = False  # whole-request mode: P's blocks reached the writer
    pending: list[tuple[int, float]] = field(default_factory=list)  # (tokens, ready)
    posted: int = 0
    last_landed: float = 0.0


class PushConnector(Connector):
    """D registers early; P's writer WRITEs into D's blocks."""

    def __init__(self, cluster: ClusterView) -> None:
        super().__init__(cluster)
        self.xfers: dict[int, _PushXfer] = {}
        self.writers: dict[str, FifoServer] = {}
        self.layers = cluster.cfg.model.num_layers

    def dispatch(self, req: SimRequest, now: float) -> None:
        p, d = self.cluster.pick_prefill.pick(), self.cluster.pick_decode.pick()
        x = _PushXfer(req, p, d, self._prefill_seq(req, p), self._decode_seq(req, d, True))
        self.xfers[req.index] = x
        self._send_leg(p, x.p_seq, now + self.leg_delay)
        self._send_leg(d, x.d_seq, now + self.leg_delay)

    def on_remote_admit(self, inst: Instance, seq: Seq, now: float) -> None:
        x = self.xfers[seq.req.index]
        arrives = self.cluster.pair_ready(x.p, inst, now) + self.sw.notify_s
        self.loop.at(arrives, self._registration, x)

    def _registration(self, x: _PushXfer) -> None:
        now = self.loop.now
        x.registered = True
        pending, x.pending = x.pending, []
        for tokens, ready in pending:
            self._post(x, tokens, self.layers, max(now, ready))
        if x.handed:
            self._post(x, x.req.prompt_len, self.layers, now)

    def on_forward(
        self, inst: Instance, seq: Seq, num_new: int, start: float, duration: float
    ) -> None:
        if not self.sw.layerwise_push or inst.role != "prefill":
            return
        x = self.xfers[seq.req.index]
        if not x.registered:
            x.pending.append((num_new, start + duration))
        elif self.sw.push_writer == "engine_loop":  # layers can only go out between steps
            self.loop.at(start + duration, self._post, x, num_new, self.layers, start + duration)
        else:
            for layer in range(self.layers):
                self._post(x, num_new, 1, start + duration * (layer + 1) / self.layers)

    def on_prefill_done(self, inst: Instance, seq: Seq, now: float) -> None:
        seq.req.prefill_done = now
        if self.sw.layerwise_push:
            return
        x = self.xfers[seq.req.index]
        if self.sw.push_handoff_next_step:
            inst.deliver(self._hand_over, x)
        else:
            self._hand_over(x)

    def _hand_over(self, x: _PushXfer) -> None:
        x.handed = True
        if x.registered:
            self._post(x, x.req.prompt_len, self.layers, self.loop.now)

    def _post(self, x: _PushXfer, tokens: int, layers: int, ready: float) -> None:
        """The writer builds and posts one WRITE of `tokens` tokens x `layers` layers."""
        cost = self.cluster.prefill_costs.post_time(tokens, layers)
        if self.sw.push_writer == "thread":
            _, posted = self.writers.setdefault(x.p.name, FifoServer()).reserve(ready, cost)
            self._send(x, tokens, layers, posted)
        else:
            work = (cost, lambda t: self._send(x, tokens, layers, t))
            self.loop.at(max(ready, self.loop.now), x.p.deliver, x.p.add_loop_work, *work)

    def _send(self, x: _PushXfer, tokens: int, layers: int, posted: float) -> None:
        num_bytes = self.cluster.prefill_costs.kv_bytes(tokens, layers)
        _, end = self.cluster.link(x.p, x.d).reserve(posted, self.cluster.wire_time(num_bytes))
        x.last_landed = max(x.last_landed, end + self.cluster.cfg.hardware.net_latency_s)
        x.posted += tokens * layers
        if x.posted == x.req.prompt_len * self.layers:
            del self.xfers[x.req.index]
            self.loop.at(x.last_landed + self.sw.notify_s, x.d.deliver, x.d.kv_arrived, x.d_seq)
            self.loop.at(x.last_landed, x.p.release, x.p_seq.blocks)


def make_connector(cluster: ClusterView) -> Connector:
    """The connector of the cluster's mode."""
    kinds = {"monolithic": MonoConnector, "pull": PullConnector, "push": PushConnector}
    return kinds[cluster.cfg.mode](cluster)
