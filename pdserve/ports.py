"""TCP ports of local processes: picking free ones for children, binding them, and checking
who listens on one.

Why this exists: a launcher picks ports for its children before they start, so a port can
be taken between the pick and the child's bind (by another child given the same port, or
by any process's outgoing connection). `free_ports` makes the picks of one launcher
distinct; a child that still finds its port taken exits with `EXIT_ADDRESS_IN_USE`, so the
launcher can start it again elsewhere; and `listens` lets a health check make sure that the
process answering on a port is the child it started, not some other one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket

# The exit status of `pdserve serve` / `pdserve router` when a port they were given is taken
# (the errno's value, so `$?` reads like the error).
EXIT_ADDRESS_IN_USE = errno.EADDRINUSE

_LISTEN_STATE = "0A"  # TCP_LISTEN in /proc/net/tcp


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now on `host` (the caller's children bind them
    moments later). Every probe socket stays bound until all are picked: a closed probe's
    port may be handed out again at once."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((host, 0))
        return [probe.getsockname()[1] for probe in probes]


def free_port(host: str = "127.0.0.1") -> int:
    """One port free right now on `host`; use `free_ports` for several at once."""
    return free_ports(1, host)[0]


def is_address_in_use(exc: BaseException) -> bool:
    """Whether `exc` says a port is taken (an OSError, or pyzmq's ZMQError, with EADDRINUSE)."""
    return getattr(exc, "errno", None) == errno.EADDRINUSE


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not listening yet (the caller listens when ready).

    SO_REUSEADDR lets a restarted server take its port back while the last one's closed
    connections sit in TIME_WAIT. On Linux it also lets a second socket bind the same port
    while neither listens; the second `listen()` then fails with EADDRINUSE, which is why a
    server must call `listen()` itself, before announcing it serves.
    """
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (any address, in the
    process's own network namespace).

    Reads /proc (Linux); where there is none, answers True: the caller cannot tell, and a
    health check must not fail for that alone.
    """
    if not os.path.exists("/proc/self/net/tcp"):
        return True
    try:
        inodes = _listening_inodes(pid, port)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # it has exited
        return False
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def _listening_inodes(pid: int, port: int) -> set[str]:
    """The inodes of the sockets listening on `port` in `pid`'s network namespace."""
    inodes: set[str] = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:  # no IPv6, or exited
            next(f)  # the header
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _LISTEN_STATE and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes
