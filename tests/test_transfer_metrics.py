"""The connector's Prometheus view exports every counter of its stats, with its value."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.transfer.metrics import ConnectorCollector
from pdserve.transfer.stats import ConnectorMetrics, ConnectorStats


def _scrape(stats: ConnectorStats, held: int) -> str:
    snap = ConnectorMetrics(mode="pull", stats=stats, blocks_held=held)
    registry = CollectorRegistry()
    registry.register(ConnectorCollector(lambda: snap))
    return generate_latest(registry).decode()


def test_every_stat_is_exported_with_its_value() -> None:
    stats = ConnectorStats()
    fields = [f for f in ConnectorStats.__struct_fields__]
    for i, name in enumerate(fields, start=1):
        setattr(stats, name, type(getattr(stats, name))(i))
    text = _scrape(stats, held=7)
    exported = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert len([n for n in exported if n.startswith("pdserve_kv_")]) == len(fields) + 1
    assert 'pdserve_kv_blocks_held{mode="pull"} 7.0' in text
    for i, name in enumerate(fields, start=1):
        assert f'mode="pull"}} {float(i)}' in text, name


def test_no_push_families_without_a_writer() -> None:
    assert "pdserve_push_" not in _scrape(ConnectorStats(), held=0)
