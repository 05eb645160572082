"""Threads whose name the operating system sees too.

Python (before 3.14) names its threads only for itself: `top -H`, `/proc/PID/task/*/comm`
and py-spy's native view show every pdserve thread under its process's name, so an idle
instance's CPU could not be told apart from its engine's (vLLM's worker threads all read
`VLLM::Worker`). `Thread` sets the OS name (Linux: the first 15 bytes) as it starts.
"""

from __future__ import annotations

import ctypes
import sys
import threading

_PR_SET_NAME = 15  # prctl(2)
_OS_NAME_BYTES = 15  # the kernel keeps 16 with the terminating NUL


class Thread(threading.Thread):
    """`threading.Thread` that also gives its name to the OS when it starts running."""

    def run(self) -> None:
        set_os_name(self.name)
        super().run()


def set_os_name(name: str) -> None:
    """Name the calling thread for the OS (Linux only; elsewhere, or on failure, nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        # dlopen(NULL): the symbols already loaded, libc's among them. Not
        # ctypes.util.find_library("c"): on Linux that runs `ldconfig -p` (a process) each call.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_OS_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError):  # no libc to load: the name is a convenience
        return
