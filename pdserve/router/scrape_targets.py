"""Prometheus file-based discovery of a router's instances, from the router's /metrics.

`pdserve up` picks the instances' ports at random, so a static scrape config cannot name
them; the router lists every instance it routes to in `pdserve_router_instance_admitted`
(open, no token needed). This writes them as a `file_sd_configs` file
(docs/prometheus/pdserve-scrape.yml), one target group per role:

    python -m pdserve.router.scrape_targets http://127.0.0.1:8000 > /tmp/pdserve-targets.json

Restarted instances keep their ports, so the file stays right for the cluster's life.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

from pdserve import http_client

INSTANCES_FAMILY = "pdserve_router_instance_admitted"


def targets(exposition: str) -> list[dict[str, Any]]:
    """Target groups (`host:port` by role) of the instances a router's /metrics lists."""
    by_role: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(exposition):
        if family.name != INSTANCES_FAMILY:
            continue
        for sample in family.samples:
            by_role[sample.labels["role"]].add(urlsplit(sample.labels["url"]).netloc)
    return [
        {"targets": sorted(hosts), "labels": {"role": role}}
        for role, hosts in sorted(by_role.items())
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Its one argument is a positional, which options.py does not declare (flags only).
    parser.add_argument("router", help="the router's URL, e.g. http://127.0.0.1:8000")
    args = parser.parse_args(argv)
    resp = http_client.get(f"{args.router.rstrip('/')}/metrics", timeout_s=10)
    resp.raise_for_status()
    print(json.dumps(targets(resp.text), indent=2))


if __name__ == "__main__":
    main()
