"""pdserve's threads carry their name to the OS (what `top -H` and /proc show)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from pdserve.threads import Thread


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
