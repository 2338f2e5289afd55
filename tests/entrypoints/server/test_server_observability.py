"""Observability: every metric the Grafana dashboard (examples/grafana_dashboard.json) queries is
one a real server exports; /health and /ping say ok, degraded or restarting (with the replicas
down) or dead; ServerMetrics' recovery counters (engine restarts, migrated requests, requests
failed after migration).

A labelled counter has no sample in prometheus_client until it is incremented, so the names
exported are read from the `# TYPE` lines (present with no samples), each expanded by its type:
a counter's line already ends in _total, a histogram's series are _bucket, _sum and _count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest.mock import MagicMock

import httpx
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from shardserve.entrypoints.server.app import build_app
from shardserve.entrypoints.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[3] / "examples" / "grafana_dashboard.json"
_NAME = re.compile(r"shardserve:[A-Za-z0-9_:]+")
_SERIES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
           "summary": ("", "_sum", "_count")}


def dashboard_queries(node) -> list[str]:
    """Every PromQL string of a dashboard: panels' (and rows' panels') `expr`, and the
    templating variables' queries."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition", "query") and isinstance(value, str):
                found.append(value)
            else:
                found += dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            found += dashboard_queries(item)
    return found


def dashboard_names(dashboard: dict) -> set[str]:
    return {name for q in dashboard_queries(dashboard) for name in _NAME.findall(q)}


def exported_names(metrics_text: str) -> set[str]:
    """The series names /metrics declares, samples or not."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            if kind == "counter" and not family.endswith("_total"):  # older prometheus_client
                family += "_total"
            names |= {family + suffix for suffix in _SERIES.get(kind, ("",))}
    return names


def test_dashboard_queries_only_exported_metrics(tiny_server):
    dashboard = json.loads(DASHBOARD.read_text())
    used = dashboard_names(dashboard)
    # What an operator needs is there: throughput, latency, queues, cache, recovery.
    for name in ("prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "prefix_cache_queries_total", "num_preemptions", "data_parallel_size",
                 "engine_restarts_total", "requests_migrated_total",
                 "requests_failed_after_migration_total"):
        assert f"shardserve:{name}" in used, name
    # Every panel reads the data source the importer picks.
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in panel["targets"])
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # histograms with samples, counters moved
    resp = httpx.post(f"{tiny_server.url}/v1/completions", json=body,
                      headers=tiny_server.headers, timeout=60)
    assert resp.status_code == 200, resp.text
    text = httpx.get(f"{tiny_server.url}/metrics", timeout=10).text
    assert "shardserve:time_to_first_token_seconds_count 0.0" not in text
    exported = exported_names(text)
    assert not used - exported, f"not exported: {sorted(used - exported)}"


def _panels(panels: list[dict]) -> list[dict]:
    return [p for panel in panels for p in (panel, *_panels(panel.get("panels", [])))]


def test_a_misspelled_name_is_caught():
    """The check fails on a name the server does not export (a typo, a missing suffix, a
    suffix a gauge does not have)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names(ServerMetrics().render().decode())
    assert not dashboard_names(dashboard) - exported
    for wrong in ("shardserve:prompt_token_total", "shardserve:engine_restarts",
                  "shardserve:num_requests_running_total",
                  "shardserve:time_to_first_token_seconds"):
        target = dashboard["panels"][1]["targets"][0]
        target["expr"] = f"sum(rate({wrong}[5m]))"
        assert dashboard_names(dashboard) - exported == {wrong}


def test_health_ok_on_a_healthy_server(tiny_server):
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        resp = httpx.request(method, f"{tiny_server.url}{path}", timeout=10)
        assert resp.status_code == 200, (path, resp.text)
        assert resp.json() == {"status": "ok"}
        assert "x-shardserve-health" not in resp.headers


def test_health_degraded_and_dead():
    """The handler on each state of the engine client (a stub: no engine)."""
    client = MagicMock(is_dead=False, health="degraded", replicas_down=[1, 3], dead_error=None)
    http = TestClient(build_app(client, "m", set(), api_key="k"))  # no key needed
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
        resp = http.request(method, path)
        assert resp.status_code == 200
        assert resp.json() == {"status": "degraded", "replicas_down": [1, 3]}
        assert resp.headers["X-Shardserve-Health"] == "degraded"
    # Every replica restarting: none serves yet (503, a load balancer sends elsewhere), but the
    # server is not dead (requests that come wait for the restart).
    client.health, client.replicas_down = "restarting", [0]
    resp = http.get("/health")
    assert resp.status_code == 503
    assert resp.json() == {"status": "restarting", "replicas_down": [0]}
    assert resp.headers["X-Shardserve-Health"] == "restarting"
    client.is_dead, client.health, client.dead_error = True, "dead", "engine core died"
    resp = http.get("/health")
    assert resp.status_code == 503
    assert resp.json()["error"] == {"message": "engine core died",
                                    "type": "ServiceUnavailableError", "param": None,
                                    "code": 503}
    assert "x-shardserve-health" not in resp.headers


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    """`name{label="v",...}` (labels sorted) → value, of the registry as /metrics renders it."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_recovery_counters():
    metrics = ServerMetrics()
    samples = _samples(metrics)
    assert samples["shardserve:requests_migrated_total"] == 0
    assert samples["shardserve:requests_failed_after_migration_total"] == 0
    assert not any(k.startswith("shardserve:engine_restarts_total") for k in samples)
    metrics.set_replicas(2, [0, 1])  # each replica's restart count starts at 0
    samples = _samples(metrics)
    assert samples['shardserve:engine_restarts_total{engine="0"}'] == 0
    assert samples['shardserve:engine_restarts_total{engine="1"}'] == 0
    metrics.on_engine_restart(1)
    metrics.on_engine_restart(1)
    metrics.on_requests_migrated(3)
    metrics.on_requests_migrated(2)
    metrics.on_requests_failed_after_migration(1)
    metrics.on_requests_failed_after_migration(0)
    metrics.remove_replica(1)  # scaled down: its gauges go, the counters keep its restarts
    metrics.set_replicas(1, [0])
    samples = _samples(metrics)
    assert samples['shardserve:engine_restarts_total{engine="0"}'] == 0
    assert samples['shardserve:engine_restarts_total{engine="1"}'] == 2
    assert samples["shardserve:requests_migrated_total"] == 5
    assert samples["shardserve:requests_failed_after_migration_total"] == 1
    assert 'shardserve:num_requests_running{engine="1"}' not in samples
