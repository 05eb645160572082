"""`pdserve bench soak`: its pure accounting, the launcher features it relies on (cluster
token, restart on the same ports), and one short real soak with aborts and a P restart."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import httpx
import msgspec
import numpy as np
import pytest
from aiohttp import web

from pdserve.bench import soak, soak_args
from pdserve.bench.soak_report import (
    Mismatch,
    PhaseCounts,
    RestartInfo,
    SoakResult,
    blocks_from_load,
    cause_of_exception,
    cause_of_http,
    cause_of_stream_error,
    count_phases,
    exit_status,
    first_difference,
    format_summary,
    group_causes,
    is_drained,
    latency_percentiles,
    normalize_message,
    oracle_sample,
    phase_of,
    total_leaked,
    unreadable_instance,
)
from pdserve.bench.soak_traffic import (
    SoakRequest,
    TrafficConfig,
    make_request,
    poisson_arrivals,
    request_body,
)
from pdserve.cluster.up_args import add_arguments, config_from_args
from pdserve.launcher import TOKEN_ENV, Cluster, ClusterConfig, InstanceSpec, serve_command

FAKE = Path(__file__).with_name("test_router_fake_instance.py")

# -- failure causes -------------------------------------------------------------------------


def test_normalize_message_masks_ids_and_numbers() -> None:
    a = normalize_message("prefill instance http://127.0.0.1:43217 failed: transfer 9f3a2c1d0b")
    b = normalize_message("prefill instance http://127.0.0.1:50001 failed: transfer 0011aabbcc")
    assert a == b == "prefill instance http://#.#.#.#:# failed: transfer #"
    assert normalize_message("no healthy prefill instance") == "no healthy prefill instance"
    assert len(normalize_message("x" * 500)) == 72


def test_http_causes_group_by_status_type_and_message_prefix() -> None:
    body = b'{"error":{"message":"KV of transfer abc123def4 lost","type":"server_error"}}'
    assert cause_of_http(502, body) == "HTTP 502 server_error: KV of transfer # lost"
    assert cause_of_http(503, b"<html>Bad gateway</html>") == (
        "HTTP 503 (not an OpenAI error body)"
    )
    assert cause_of_http(422, b'{"detail":"bad"}') == "HTTP 422 detail: bad"
    assert cause_of_http(400, b'{"error":"plain text"}') == "HTTP 400 plain text"
    event = b'{"message":"decode instance died","type":"upstream_error"}'
    assert cause_of_stream_error(event) == "stream error upstream_error: decode instance died"
    disconnected = aiohttp.ServerDisconnectedError()
    assert cause_of_exception(disconnected) == "transport ServerDisconnectedError"


def test_group_causes_counts_most_frequent_first() -> None:
    causes = ["b", None, "a", "b", "c", "a", "b"]
    assert group_causes(causes) == {"b": 3, "a": 2, "c": 1}
    assert list(group_causes(["z", "y"])) == ["y", "z"]  # ties by name


# -- KV blocks ------------------------------------------------------------------------------


def _load(used: int, running: int = 0, waiting_for_kv: int = 0) -> bytes:
    return msgspec.json.encode(
        {
            "num_running": running,
            "num_waiting": 0,
            "num_waiting_for_kv": waiting_for_kv,
            "kv_blocks_used": used,
            "kv_blocks_total": 4096,
        }
    )


def test_leak_accounting_from_load() -> None:
    clean = blocks_from_load("prefill-0", 11, 1, _load(0))
    assert (clean.kv_blocks_free, clean.leaked, clean.restarts) == (4096, 0, 1)
    assert is_drained(clean)
    leaky = blocks_from_load("decode-0", 12, 0, _load(7))
    assert (leaky.kv_blocks_free, leaky.leaked) == (4089, 7) and not is_drained(leaky)
    busy = blocks_from_load("decode-0", 12, 0, _load(0, waiting_for_kv=1))
    assert not is_drained(busy)
    gone = unreadable_instance("prefill-0", 13, 0, "ConnectError")
    assert not is_drained(gone)
    assert total_leaked([clean, leaky, gone]) == 8  # an unreadable instance counts 1
    with pytest.raises(msgspec.DecodeError):
        blocks_from_load("x", 1, 0, b'{"kv_blocks_used": 1}')


# -- oracle ---------------------------------------------------------------------------------


def test_latency_percentiles() -> None:
    assert latency_percentiles([]) == (None, None)
    p50, p99 = latency_percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p50 == 3.0 and p99 == pytest.approx(4.96)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def test_oracle_sample_takes_the_ceiling_fraction_without_replacement() -> None:
    candidates = list(range(0, 200, 2))
    picked = oracle_sample(candidates, 0.1, np.random.default_rng(0))
    assert len(picked) == 10 and len(set(picked)) == 10 and set(picked) <= set(candidates)
    assert picked == sorted(picked)
    assert picked == oracle_sample(candidates, 0.1, np.random.default_rng(0))
    assert len(oracle_sample([5, 6, 7], 0.1, np.random.default_rng(0))) == 1
    assert oracle_sample([5, 6], 0.0, np.random.default_rng(0)) == []
    assert oracle_sample([], 0.5, np.random.default_rng(0)) == []


# -- phases, result and summary -------------------------------------------------------------

RESTART = RestartInfo(
    instance="prefill-0",
    killed_s=10.0,
    ready_s=20.0,
    settled_s=25.0,
    old_pid=1,
    new_pid=2,
    old_incarnation="a",
    new_incarnation="b",
)


def test_phases_split_at_the_kill_and_the_settle_time() -> None:
    assert phase_of(9.9, RESTART) == "before" and phase_of(99.0, None) == "before"
    assert phase_of(10.0, RESTART) == phase_of(24.9, RESTART) == "during"
    assert phase_of(25.0, RESTART) == "after"
    sent = [(1.0, "completed"), (2.0, "aborted"), (12.0, "failed"), (30.0, "completed")]
    phases = count_phases(sent, RESTART)
    assert phases["before"] == PhaseCounts(sent=2, completed=1, aborted=1)
    assert phases["during"] == PhaseCounts(sent=1, failed=1)
    assert phases["after"] == PhaseCounts(sent=1, completed=1)


def _result(leaked: int = 0, mismatches: list[Mismatch] | None = None) -> SoakResult:
    blocks = blocks_from_load("decode-0", 12, 0, _load(leaked))
    return SoakResult(
        date="20261130-130000",
        mode="push",
        transport="tcp",
        model="builtin:tiny",
        duration_s=60.0,
        drain_s=2.0,
        request_rate=3.0,
        rate_derived=True,
        input_len=(64, 512),
        output_len=(8, 64),
        abort_fraction=0.2,
        max_concurrency=32,
        seed=0,
        sent=180,
        completed=140,
        aborted=30,
        failed=10,
        output_tokens=5000,
        latency_p50_s=1.5,
        latency_p99_s=9.25,
        causes={"HTTP 503 server_error: no healthy prefill instance": 10},
        phases=count_phases([(1.0, "completed")], RESTART),
        restart=RESTART,
        instances=[blocks],
        blocks_leaked=total_leaked([blocks]),
        oracle_candidates=100,
        oracle_checked=10,
        oracle_failed=0,
        mismatches=mismatches or [],
        failed_requests=[],
        load_average=(1.0, 1.0, 1.0),
        log_dir="/tmp/x",
    )


def test_exit_status_and_summary() -> None:
    ok = _result()
    assert exit_status(ok) == 0
    text = format_summary(ok)
    assert "sent 180: completed 140 ( 77.8%)" in text and "PASS" in text
    assert "HTTP 503 server_error" in text and "decode-0" in text
    assert "p50 1.50 s, p99 9.25 s" in text
    assert len(text.splitlines()) < 40  # one screen
    assert exit_status(_result(leaked=3)) == 1
    wrong = Mismatch(index=4, prompt_len=9, max_tokens=8, first_difference=2, got=[5], want=[6])
    bad = _result(mismatches=[wrong])
    assert exit_status(bad) == 1 and "request 4: first difference at token 2" in format_summary(bad)
    decoded = msgspec.json.decode(msgspec.json.encode(bad), type=SoakResult)
    assert decoded.mismatches == [wrong] and decoded.restart == RESTART


# -- traffic --------------------------------------------------------------------------------


def test_requests_follow_the_mix() -> None:
    cfg = TrafficConfig(input_len=(5, 9), output_len=(2, 4), abort_fraction=0.5)
    rng = np.random.default_rng(1)
    reqs = [make_request(i, 0.0, cfg, rng) for i in range(200)]
    assert all(5 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 4 for r in reqs)
    assert all(10 <= t < 256 for r in reqs for t in r.prompt)
    aborted = [r for r in reqs if r.aborts]
    assert 0 < len(aborted) < 200
    assert all(0 <= (r.abort_after_tokens or 0) < r.max_tokens for r in aborted)
    assert all(0 <= (r.abort_after_s or 0) <= cfg.abort_window_s for r in aborted)
    never = TrafficConfig(abort_fraction=0.0)
    assert not any(make_request(i, 0.0, never, rng).aborts for i in range(50))
    with pytest.raises(ValueError):
        TrafficConfig(input_len=(9, 5))


def test_request_body_is_greedy_and_asks_for_token_ids_when_not_streaming() -> None:
    req = make_request(0, 0.0, TrafficConfig(abort_fraction=0.0), np.random.default_rng(0))
    kept = request_body("m", req, stream=False)
    assert kept["temperature"] == 0 and kept["ignore_eos"] and kept["return_token_ids"]
    assert kept["max_tokens"] == req.max_tokens and kept["prompt"] == req.prompt
    assert "return_token_ids" not in request_body("m", req, stream=True)


def test_poisson_arrivals_stay_in_the_window_and_increase() -> None:
    times = list(poisson_arrivals(5.0, 20.0, np.random.default_rng(0)))
    assert times and all(0 < t < 20.0 for t in times)
    assert times == sorted(times)
    assert list(poisson_arrivals(5.0, 20.0, np.random.default_rng(0))) == times


def test_cli_flags_map_to_the_config() -> None:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    argv = (
        "--duration-min 0.5 --mode pull --input-len 10 20 --output-len 3 4 --abort-fraction 0.3"
        " --no-restart --oracle-sample 0.2 --request-rate 2 -- --kv-lease 5"
    )
    cfg = soak_args.config_from_args(parser.parse_args(argv.split()))
    assert (cfg.mode, cfg.duration_s, cfg.restart_at, cfg.request_rate) == ("pull", 30.0, None, 2)
    assert cfg.traffic.input_len == (10, 20) and cfg.traffic.output_len == (3, 4)
    assert cfg.traffic.abort_fraction == 0.3 and cfg.oracle_sample == 0.2
    assert cfg.instance_args == ("--kv-lease", "5")
    default = soak_args.config_from_args(parser.parse_args([]))
    assert (default.mode, default.duration_s, default.restart_at) == ("push", 600.0, 0.5)
    assert default.model == "builtin:small" and default.request_rate is None
    with pytest.raises(ValueError):
        soak.SoakConfig(restart_at=1.5)


# -- launcher: cluster token and restarts ----------------------------------------------------


def test_serve_command_passes_a_fixed_side_channel_port() -> None:
    spec = InstanceSpec("prefill", 0, "127.0.0.1", 9001, "push", "tcp", None, None, (), 9101)
    assert "--side-channel-port 9101" in " ".join(serve_command(spec))
    mono = InstanceSpec("both", 0, "127.0.0.1", 9002, None, "tcp", None, None, ())
    assert "--side-channel-port" not in serve_command(mono)
    specs = Cluster(ClusterConfig(kv_transfer="pull", pin_cores=False)).instance_specs()
    ports = [s.side_port for s in specs]
    assert all(ports) and len(set(ports)) == 2


def test_cluster_token_is_random_unless_given(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    a = Cluster(ClusterConfig(log_dir=tmp_path), env=env).cluster_token
    b = Cluster(ClusterConfig(log_dir=tmp_path), env=env).cluster_token
    assert len(a) == 32 and a != b
    assert Cluster(ClusterConfig(cluster_token="s3cret"), env=env).cluster_token == "s3cret"
    assert Cluster(ClusterConfig(), env={**env, TOKEN_ENV: "fromenv"}).cluster_token == "fromenv"
    path = Cluster(ClusterConfig(log_dir=tmp_path), env=env).write_token_file()
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text().strip()) == 32
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--kv-transfer", "push", "--cluster-token", "t0k"])
    assert config_from_args(args).cluster_token == "t0k"


def _token_recording_fake(spec: InstanceSpec) -> list[str]:
    """A fake instance that first writes the cluster token it was given next to its log."""
    record = Path(os.environ["SOAK_TEST_DIR"]) / f"{spec.name}.token"
    script = (
        "import os, runpy, sys;"
        f"open({str(record)!r}, 'a').write(os.environ.get({TOKEN_ENV!r}, '') + '\\n');"
        f"sys.argv = [{str(FAKE)!r}, '--role', {spec.role!r}, '--port', {str(spec.port)!r}];"
        f"runpy.run_path({str(FAKE)!r}, run_name='__main__')"
    )
    return [sys.executable, "-c", script]


@pytest.mark.slow  # a 3-process cluster, one instance restarted
@pytest.mark.timeout(120)
def test_instances_get_the_token_and_restart_on_the_same_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOAK_TEST_DIR", str(tmp_path))
    config = ClusterConfig(kv_transfer="push", log_dir=tmp_path, port=None, startup_timeout_s=60)
    with Cluster(config, instance_command=_token_recording_fake) as cluster:
        old = cluster.instance("prefill-0")
        new = cluster.restart_instance("prefill-0")
        assert old.popen.returncode == -9 and new.alive() and new.pid != old.pid
        assert new.url == old.url and new.restarts == 1 and cluster.instances[0] is new
        assert httpx.get(f"{new.url}/health", timeout=5).status_code == 200
        with pytest.raises(KeyError):
            cluster.instance("prefill-7")
        token = cluster.cluster_token
    assert not new.alive()
    tokens = (tmp_path / "prefill-0.token").read_text().split()
    assert tokens == [token, token]  # the first start and the restart
    assert (tmp_path / "decode-0.token").read_text().split() == [token]
    assert new.log_path.read_text().count("$ ") == 2  # the restart appended to the log


# -- the real thing, short ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_push_soak_with_aborts_and_a_prefill_restart(tmp_path: Path) -> None:
    cfg = soak.SoakConfig(
        mode="push",
        model="builtin:tiny",
        duration_s=40.0,
        request_rate=3.0,
        traffic=TrafficConfig(input_len=(32, 512), output_len=(4, 48), abort_fraction=0.25),
        restart_at=0.2,
        oracle_sample=0.3,
        request_timeout_s=60.0,
        drain_timeout_s=90.0,
        out_dir=tmp_path,
        progress=False,
    )
    result, path = soak.run_soak(cfg)
    assert msgspec.json.decode(path.read_bytes(), type=SoakResult).sent == result.sent
    summary = format_summary(result)
    assert result.restart is not None, summary
    assert result.restart.new_incarnation != result.restart.old_incarnation, summary
    assert result.blocks_leaked == 0, summary
    assert all(b.error is None and b.kv_blocks_total > 0 for b in result.instances), summary
    assert result.oracle_checked > 0 and result.oracle_failed == 0, summary
    assert result.mismatches == [], summary
    assert result.aborted > 0, summary
    after = result.phases["after"]
    assert after.completed > 0 and after.failed == 0, summary
    assert math.isclose(result.duration_s, 40.0)
    assert exit_status(result) == 0


@pytest.mark.slow  # `pdserve up` with fake instances
@pytest.mark.timeout(120)
def test_up_command_generates_and_files_a_cluster_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_launcher_cluster import _run_up

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    proc, lines = _run_up(tmp_path, "--kv-transfer", "push")
    try:
        assert any(f"cluster token in {tmp_path / 'cluster-token'}" in line for line in lines)
        token_file = tmp_path / "cluster-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 32 and all(token not in line for line in lines)
        pids = [
            int(line.split()[line.split().index("pid") + 1]) for line in lines if " pid " in line
        ]
        instance_pids = pids[:2]  # prefill, decode (the router is listed last)
        for pid in instance_pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"{TOKEN_ENV}={token}".encode() in environ
    finally:
        proc.terminate()
        proc.wait(30)


class _NoCluster:
    """Stands in for the oracle's monolithic Cluster (no process)."""

    def __init__(self, config: ClusterConfig) -> None:
        assert config.monolithic
        self.router_url = "http://127.0.0.1:1"

    def __enter__(self) -> _NoCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_oracle_reports_wrong_and_unanswered_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.bench.soak_traffic import SoakOutcome

    rng = np.random.default_rng(0)
    mix = TrafficConfig(input_len=(4, 4), output_len=(3, 3), abort_fraction=0.0)
    requests = {i: make_request(i, 0.0, mix, rng) for i in range(3)}
    ids = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9]}
    outcomes = [
        SoakOutcome(
            index=i,
            status="completed",
            sent_s=0,
            ended_s=1,
            prompt_len=4,
            max_tokens=3,
            token_ids=ids[i],
        )
        for i in range(3)
    ]
    oracle_ids = {0: [1, 2, 3], 1: [4, 0, 6], 2: None}  # right, wrong at 1, unanswered

    async def replay(cfg, url, model, sample):
        return [oracle_ids[r.index] for r in sample]

    monkeypatch.setattr(soak, "Cluster", _NoCluster)
    monkeypatch.setattr(soak, "_replay", replay)
    traffic = soak._Traffic("m", 1.0, requests, outcomes, None, [], 0.0)
    cfg = soak.SoakConfig(oracle_sample=1.0, out_dir=tmp_path)
    candidates, checked, unanswered, mismatches = soak.run_oracle(cfg, tmp_path, traffic, rng)
    assert (candidates, checked, unanswered) == (3, 3, 1)
    assert [(m.index, m.first_difference, m.got, m.want) for m in mismatches] == [
        (1, 1, [5, 6], [0, 6])
    ]


@asynccontextmanager
async def _sse_server(body: bytes) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """A session and the completions URL of a local server that answers every POST with
    `body` as an SSE stream, sent in 7-byte pieces."""

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), 7):
            await resp.write(body[i : i + 7])
            await asyncio.sleep(0.001)  # each piece read on its own
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            yield http, f"http://127.0.0.1:{port}/v1/completions"
    finally:
        await runner.cleanup()


def _token_event(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"' + text.encode() + b'"}]}\r\n\r\n'


@pytest.mark.parametrize(("abort_after", "completed"), [(2, False), (9, True)])
def test_a_streamed_soak_request_stops_at_its_abort_point_or_done(
    abort_after: int, completed: bool
) -> None:
    from pdserve.bench.soak_traffic import _stream_until_abort

    # U+2028 inside the JSON: not a line end in SSE, so it must not split an event.
    body = b": keep-alive\n\n" + b"".join(_token_event(t) for t in ("a", "b\u2028", "c"))
    body += b"data: [DONE]\r\n\r\n"
    req = SoakRequest(index=0, prompt=[1], max_tokens=3, arrival_s=0.0)
    req = msgspec.structs.replace(req, abort_after_tokens=abort_after, abort_after_s=9.0)
    seen = [0]

    async def run() -> bool:
        async with _sse_server(body) as (http, url):
            return await _stream_until_abort(http, url, "m", req, seen)

    assert asyncio.run(run()) is completed
    assert seen == [abort_after if not completed else 3]


def test_an_error_event_fails_a_streamed_soak_request() -> None:
    from pdserve.bench.soak_traffic import _Failed, _stream_until_abort

    body = _token_event("a") + b'data: {"error":{"message":"boom","type":"x"}}\n\n'
    req = SoakRequest(index=0, prompt=[1], max_tokens=3, arrival_s=0.0, abort_after_tokens=5)

    async def run() -> bool:
        async with _sse_server(body) as (http, url):
            return await _stream_until_abort(http, url, "m", req, [0])

    with pytest.raises(_Failed) as failed:
        asyncio.run(run())
    assert failed.value.cause.startswith("stream error"), failed.value.cause
