"""pdserve's threads carry their name to the OS (what `top -H` and /proc show)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from pdserve.threads import Thread, set_os_name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
def test_the_os_sees_the_thread_name_cut_to_15_bytes() -> None:
    seen: list[str] = []

    def read_comm() -> None:
        tid = threading.get_native_id()
        seen.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())

    t = Thread(target=read_comm, name="pdserve-heartbeat-and-more")
    t.start()
    t.join(5)
    assert seen == ["pdserve-heartbe"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl names are Linux's")
def test_naming_a_thread_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine, connector and transport thread is named as it starts: that must not run
    a program (ctypes.util.find_library does: `ldconfig -p`), a fork per thread, refused in
    the unit tier (tests/conftest.py), where it ended the engine thread."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("naming a thread started a process")

    monkeypatch.setattr("subprocess.Popen._execute_child", refuse)
    seen: list[str] = []

    def name_and_read() -> None:
        set_os_name("pdserve-named")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = threading.Thread(target=name_and_read)
    t.start()
    t.join(5)
    assert seen == ["pdserve-named"]
