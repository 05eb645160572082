"""Trace records as log lines: `PREFIX` + the record's JSON, written and read back.

The engine's step trace (`pdserve.engine.steptrace`) and the handoff trace
(`pdserve.transfer.hoptrace`) log one msgspec struct per line on DEBUG through `logging`,
so the lines carry whatever the handler adds in front (time, level, logger name). Reading
them back finds the prefix after the logger's name and decodes the rest. Nothing is kept.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


def log_record(logger: logging.Logger, prefix: str, record: msgspec.Struct) -> None:
    """Log `record` on DEBUG as `prefix` + its JSON (callers check `isEnabledFor` first)."""
    logger.debug("%s%s", prefix, msgspec.json.encode(record).decode())


def parse_record(line: str, logger_name: str, prefix: str, kind: type[T]) -> T | None:
    """The `kind` record in a line that `log_record` wrote on `logger_name` with `prefix`,
    or None for any other line."""
    i = line.find(prefix + "{")
    if i < 0 or logger_name not in line[:i]:
        return None
    return msgspec.json.decode(line[i + len(prefix) :].strip(), type=kind)
