"""Handoff trace: `hop` lines read back by `parse_hop_line`; off by default."""

from __future__ import annotations

import logging

from pdserve.tracelog import HOP_LOGGER, hop, parse_hop_line

SERVE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # pdserve serve's


def test_hop_lines_read_back(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger=HOP_LOGGER)
    hop("t1", "p.prefill_done", t=123.5, layer=3)
    fmt = logging.Formatter(SERVE_FORMAT)
    (rec,) = [parse_hop_line(fmt.format(r)) for r in caplog.records if r.name == HOP_LOGGER]
    assert (rec.key, rec.name, rec.t) == ("t1", "p.prefill_done", 123.5)
    assert rec.extra["layer"] == 3
    assert rec.extra["cpu"] >= 0.0  # the calling thread's CPU time rides along


def test_off_by_default(caplog) -> None:
    caplog.set_level(logging.INFO, logger=HOP_LOGGER)
    hop("t1", "p.prefill_done")
    assert not [r for r in caplog.records if r.name == HOP_LOGGER]


def test_other_lines_are_not_hops() -> None:
    assert parse_hop_line("2026-12-01 DEBUG pdserve.engine.steps: step {}") is None
    assert parse_hop_line('2026-12-01 INFO pdserve.serve: hop {"key": "x"}') is None


def test_hop_lines_in_vllms_log_format_read_back() -> None:
    """Inside vLLM's processes pdserve logs through vLLM's handler, whose format names the
    file that logged instead of the logger (pdserve.vllm.connector)."""
    line = (
        "(Worker pid=27985) DEBUG 12-03 09:19:29 [tracelog.py:35] hop "
        '{"key":"t1","name":"p.layers_done","t":1796289569.25,"extra":{"cpu":0.5}}'
    )
    rec = parse_hop_line(line)
    assert rec is not None and (rec.key, rec.name, rec.t) == ("t1", "p.layers_done", 1796289569.25)
    assert parse_hop_line(line.replace("tracelog.py", "serving.py")) is None
