"""What the docs tell users to query exists: every series the Grafana dashboard's PromQL
reads, and every name of the endpoint picker's settings (docs/metrics.md), on a live push
1P1D cluster after a few requests; and the scrape config and its target list fit it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import Cluster, ClusterConfig
from pdserve.router.scrape_targets import targets

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "pdserve-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
SCRAPE_CONFIG = ROOT / "docs" / "prometheus" / "pdserve-scrape.yml"

# Every pdserve series name in a PromQL expression; label names never start with pdserve.
_NAME = re.compile(r"\bpdserve[_:][A-Za-z0-9_:]*")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# The three the protocol requires, and where the EPP's settings name them.
_EPP_SPECS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")
_EPP_FLAGS = (
    "total-queued-requests-metric",
    "total-running-requests-metric",
    "kv-cache-usage-percentage-metric",
)


# -- what the docs query --------------------------------------------------------------------


def _strings_under(node: Any, keys: frozenset[str]) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in keys and isinstance(v, str):
                yield v
            else:
                yield from _strings_under(v, keys)
    elif isinstance(node, list):
        for v in node:
            yield from _strings_under(v, keys)


def dashboard_queries() -> list[str]:
    """The PromQL of every panel target and of the template variables."""
    dash = json.loads(DASHBOARD.read_text())
    return list(_strings_under(dash, frozenset({"expr", "query", "definition"})))


def dashboard_names() -> set[str]:
    return {name for q in dashboard_queries() for name in _NAME.findall(q)}


def _spec_name(spec: str) -> str:
    """The family of a selector spec, `family{label=value}`."""
    return spec.split("{", 1)[0].strip()


def epp_config_names() -> dict[str, str]:
    """Spec field -> metric name, from the `engineConfigs` entry `pdserve` in the docs."""
    blocks = re.findall(r"```yaml\n(.*?)```", METRICS_DOC.read_text(), re.S)
    for block in blocks:
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and doc.get("kind") == "EndpointPickerConfig":
            (extractor,) = [p for p in doc["plugins"] if p["type"] == "core-metrics-extractor"]
            (engine,) = [e for e in extractor["parameters"]["engineConfigs"]]
            assert engine["name"] == "pdserve"
            return {k: _spec_name(v) for k, v in engine.items() if k.endswith("Spec") and v}
    raise AssertionError("no EndpointPickerConfig in docs/metrics.md")


def epp_flag_names() -> dict[str, str]:
    """Flag -> metric name, from the `--...-metric=NAME` lines of the docs (empty: off)."""
    found = re.findall(r"^--([a-z-]+-metric)=(\S*)$", METRICS_DOC.read_text(), re.M)
    return {flag: _spec_name(value) for flag, value in found if value}


def test_docs_name_what_the_endpoint_picker_needs() -> None:
    config, flags = epp_config_names(), epp_flag_names()
    assert set(_EPP_SPECS) <= set(config)
    assert set(_EPP_FLAGS) <= set(flags)
    # The two forms of the settings name the same metrics.
    assert [config[s] for s in _EPP_SPECS] == [flags[f] for f in _EPP_FLAGS]
    assert config["cacheInfoSpec"] == flags["cache-info-metric"]


def test_dashboard_queries_histograms_through_their_buckets() -> None:
    queries = dashboard_queries()
    assert len(queries) > 20
    quantiles = [q for q in queries if "histogram_quantile" in q]
    assert quantiles and all("_bucket" in q and "by (le" in q for q in quantiles)
    for needed in (
        "pdserve_router_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_kv_transfer_duration_seconds_bucket",
        "pdserve_router_handoff_seconds_bucket",
        "pdserve_router_instance_restarts_total",
        "pdserve_router_instance_ejections_total",
        "pdserve_router_leg_errors_total",
    ):
        assert needed in dashboard_names(), needed


def test_scrape_config_names_the_router_and_the_discovered_instances() -> None:
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    router = jobs["pdserve-router"]["static_configs"][0]["targets"]
    assert router == ["127.0.0.1:8000"]  # `pdserve up`'s default --port
    (sd,) = jobs["pdserve-instances"]["file_sd_configs"]
    assert sd["files"] == ["/tmp/pdserve-targets.json"]
    assert "scrape_targets http://127.0.0.1:8000 > /tmp/pdserve-targets.json" in (
        METRICS_DOC.read_text()
    )


# -- what a live cluster exports ------------------------------------------------------------


class Exposition:
    """The series names one /metrics declares (`# TYPE`) and those it has samples of."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        self.samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        self.sample_names = {name for name, _ in self.samples}

    def has(self, name: str) -> bool:
        """A sample of `name`, or a declared family `name` is a series of (a labelled family
        with no children yet, e.g. leg errors before any error, has only its `# TYPE`)."""
        if name in self.sample_names or name in self.types:
            return True
        for suffix in _HISTOGRAM_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and self.types.get(base) == "histogram":
                return True
        return False

    def value(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, lab), v in self.samples.items() if n == name and want <= set(lab))


def _scrape(url: str) -> Exposition:
    resp = httpx.get(f"{url}/metrics", timeout=10)  # open: no key, no cluster token
    assert resp.status_code == 200
    return Exposition(resp.text)


def _stream(url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "extra",
    [(), ("--engine-process",)],  # the connector's histograms cross to the front end too
    ids=["in_process", "engine_process"],
)
def test_every_documented_series_exists_on_a_live_push_cluster(
    tmp_path: Path, extra: tuple[str, ...]
) -> None:
    cfg = ClusterConfig(
        kv_transfer="push",
        model="builtin:tiny",
        port=None,
        log_dir=tmp_path,
        local_prefill_below=0,  # every request goes through P and a transfer
        instance_args=extra,
    )
    with Cluster(cfg) as cluster:
        for i in range(3):
            _stream(cluster.router_url, [5 + i] * 40, max_tokens=8)
        router = _scrape(cluster.router_url)
        by_role = {p.role: _scrape(p.url) for p in cluster.instances}
        instance_urls = {p.role: urlsplit(p.url).netloc for p in cluster.instances}
    p, d = by_role["prefill"], by_role["decode"]
    everywhere = [router, p, d]

    missing = sorted(n for n in dashboard_names() if not any(e.has(n) for e in everywhere))
    assert not missing, f"the dashboard queries series nobody exports: {missing}"

    # The picker reads a gauge of each instance it scores, with the served model's name.
    for name in epp_config_names().values():
        for role, inst in by_role.items():
            assert inst.types.get(name) == "gauge", (name, role)
            (labels,) = [lab for n, lab in inst.samples if n == name]
            assert dict(labels)["model_name"], (name, role)
    assert 0 <= d.value("pdserve:kv_cache_usage_perc") <= 1

    # The new histograms hold the requests just served, not only declared families.
    assert d.value("pdserve_inter_token_latency_seconds_count") >= 3 * (8 - 1)
    transfers = p.value("pdserve_kv_transfers_total")
    assert transfers >= 1
    assert p.value("pdserve_kv_transfer_duration_seconds_count") == transfers
    received = d.value("pdserve_kv_received_total")
    assert received >= 1
    assert d.value("pdserve_kv_handoff_seconds_count") == received
    assert d.value("pdserve_kv_recv_wait_duration_seconds_count") == received
    assert router.value("pdserve_router_handoff_seconds_count") >= 1

    # The scrape targets that the router's /metrics yields are the cluster's instances.
    groups = {g["labels"]["role"]: g["targets"] for g in targets(router.text)}
    assert groups == {role: [host] for role, host in instance_urls.items()}
