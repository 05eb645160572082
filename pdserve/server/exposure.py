"""The loud start-up warning of a process that listens beyond loopback unprotected.

Pure functions returning the WARNING text, or None when there is nothing to say; `pdserve
serve`, `pdserve router` and `pdserve up` log it once at start (their `main`). The rules
(docs/transport.md, "Connector security"):

- `serve` with a P/D role, no cluster token, and its HTTP host or `--kv-host` beyond
  loopback: anyone who reaches it can send P/D legs (hold its blocks, fill its slots), read
  /kv/info and /load, and join its KV transport and side channel.
- `router` without a cluster token, listening beyond loopback or fronting instances beyond
  loopback: those instances cannot require signed legs from it, so they must be open too.
- `up` always has a cluster token; its instances listen on loopback. Only its router (or
  monolithic instance) follows `--host`: beyond loopback without `--api-key`, anyone who
  reaches it can use the model.

Not imported by anything heavy; `pdserve --help` may import it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

_FIX = "set the same --cluster-token (or $PDSERVE_CLUSTER_TOKEN) on every instance and the router"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this host only; wildcards are not."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another name: it resolves to who knows what


def serve_warning(role: str, http_host: str, kv_host: str, token: str | None) -> str | None:
    """`pdserve serve`'s warning, or None (a monolithic role, a token, or loopback only)."""
    if role == "both" or token:
        return None
    exposed = [f"HTTP on {http_host}"] if not is_loopback(http_host) else []
    exposed += [f"KV side channel and transport on {kv_host}"] if not is_loopback(kv_host) else []
    if not exposed:
        return None
    return (
        f"this {role} instance listens beyond loopback ({'; '.join(exposed)}) WITHOUT a "
        "cluster token: anyone who reaches it can send P/D legs (hold its KV blocks, fill its "
        "slots), read /kv/info and /load, and join its KV transport and side channel. To fix: "
        f"{_FIX}, or listen on 127.0.0.1"
    )


def router_warning(host: str, instance_urls: Iterable[str], token: str | None) -> str | None:
    """`pdserve router`'s warning, or None (a token, or everything on loopback)."""
    if token:
        return None
    remote = [u for u in instance_urls if not is_loopback(urlsplit(u).hostname or "")]
    if is_loopback(host) and not remote:
        return None
    where = f"listens on {host}" if not is_loopback(host) else f"fronts {', '.join(remote)}"
    return (
        f"the router {where} WITHOUT a cluster token: its instances cannot require signed P/D "
        "legs, so anyone who reaches them can send legs that hold their KV blocks and slots, "
        f"and /router/instances lists them to anyone with the API key. To fix: {_FIX}"
    )


def up_warning(host: str, api_key: str | None) -> str | None:
    """`pdserve up`'s warning, or None (loopback, or an API key)."""
    if api_key or is_loopback(host):
        return None
    return (
        f"the cluster's front door listens on {host} WITHOUT an API key: anyone who reaches "
        "it can use the model (its P/D instances stay on 127.0.0.1 and need the cluster "
        "token). To fix: --api-key (or $PDSERVE_API_KEY), or --host 127.0.0.1"
    )
