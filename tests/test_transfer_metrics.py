"""The connector's Prometheus view exports every counter of its stats, with its value, and
its histograms with their buckets."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.transfer.buckets import Buckets
from pdserve.transfer.metrics import ConnectorCollector
from pdserve.transfer.stats import ConnectorMetrics, ConnectorStats


def _scrape(stats: ConnectorStats, held: int) -> str:
    snap = ConnectorMetrics(mode="pull", stats=stats, blocks_held=held)
    registry = CollectorRegistry()
    registry.register(ConnectorCollector(lambda: snap))
    return generate_latest(registry).decode()


def test_every_stat_is_exported_with_its_value() -> None:
    stats = ConnectorStats()
    fields = [f for f in ConnectorStats.__struct_fields__ if _is_number(getattr(stats, f))]
    for i, name in enumerate(fields, start=1):
        setattr(stats, name, type(getattr(stats, name))(i))
    text = _scrape(stats, held=7)
    exported = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    counters = [n for n in exported if n.startswith("pdserve_kv_") and n.endswith("_total")]
    assert len(counters) == len(fields)
    assert 'pdserve_kv_blocks_held{mode="pull"} 7.0' in text
    for i, name in enumerate(fields, start=1):
        assert f'mode="pull"}} {float(i)}' in text, name


def test_no_push_families_without_a_writer() -> None:
    assert "pdserve_push_" not in _scrape(ConnectorStats(), held=0)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float)


def test_every_histogram_is_exported_with_its_buckets() -> None:
    stats = ConnectorStats()
    hists = [f for f in ConnectorStats.__struct_fields__ if isinstance(getattr(stats, f), Buckets)]
    assert len(hists) == 3
    stats.transfer_time.observe(0.002)  # in (0.001, 0.0025]
    stats.transfer_time.observe(0.0025)  # on a bound: counted there (le is inclusive)
    stats.transfer_time.observe(99.0)  # above every bound: only in +Inf
    stats.handoff_time.observe(0.0004)
    text = _scrape(stats, held=0)
    name = "pdserve_kv_transfer_duration_seconds"
    assert f'{name}_bucket{{le="0.001",mode="pull"}} 0.0' in text
    assert f'{name}_bucket{{le="0.0025",mode="pull"}} 2.0' in text
    assert f'{name}_bucket{{le="10.0",mode="pull"}} 2.0' in text
    assert f'{name}_bucket{{le="+Inf",mode="pull"}} 3.0' in text
    assert f'{name}_count{{mode="pull"}} 3.0' in text
    assert f'{name}_sum{{mode="pull"}} 99.0045' in text
    assert 'pdserve_kv_handoff_seconds_bucket{le="0.0005",mode="pull"} 1.0' in text
    assert 'pdserve_kv_recv_wait_duration_seconds_count{mode="pull"} 0.0' in text


def test_histograms_survive_the_core_process_snapshot() -> None:
    """Across processes the front end reads a msgspec copy (engine/core_protocol.py)."""
    import msgspec

    stats = ConnectorStats()
    stats.recv_wait_time.observe(0.3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=ConnectorStats)
    assert back.recv_wait_time == stats.recv_wait_time
    assert 'pdserve_kv_recv_wait_duration_seconds_bucket{le="0.5",mode="pull"} 1.0' in _scrape(
        back, held=0
    )
