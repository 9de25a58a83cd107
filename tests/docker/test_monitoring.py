"""The compose `monitoring` profile's files agree with kvflow: Prometheus scrapes the
frontend where compose runs it, Grafana reads that Prometheus, and every metric the dashboard
plots is one kvflow exports. Static: the Prometheus and Grafana images come from Docker Hub,
which CI cannot reach, so they are not started here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.frontend.metrics.prometheus import Metrics
from tests.unit.snapshots import stats

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "docker" / "monitoring"
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def exported_metrics() -> set[str]:
    """The names /metrics exposes, histograms with their _bucket/_sum/_count series."""
    text = Metrics("m").render([stats()], num_tokenizer_workers=2, num_in_flight=3)
    return {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}


def test_the_dashboard_plots_only_metrics_kvflow_exports() -> None:
    dashboard = json.loads((MONITORING / "grafana" / "kvflow-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"kvflow:[a-z0-9_]+", expr)}
    assert used <= exported_metrics(), sorted(used - exported_metrics())
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "throughput", "kv cache", "waiting", "preempt"):
        assert topic in titles
    assert "prefix cache hit" in titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_engines_figures_are_not_counted_once_per_frontend() -> None:
    """Every frontend exports the scheduler's snapshot (and the same tokenizer pool): with two
    frontends, a sum would double them; only the frontends' own request figures add up."""
    own = ("time_to_first_token", "inter_token_latency", "e2e_request", "request_success")
    dashboard = json.loads((MONITORING / "grafana" / "kvflow-dashboard.json").read_text())
    aggregated = re.compile(
        r"\b(sum|max|min|avg)\b(?:\s*by\s*\([^)]*\))?\s*\((?:rate\()?(kvflow:[a-z0-9_]+)"
    )
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            found = aggregated.findall(target["expr"])
            assert len(found) == len(re.findall(r"kvflow:", target["expr"])), target["expr"]
            for aggregation, name in found:
                expected = "sum" if name.startswith(tuple(f"kvflow:{o}" for o in own)) else "max"
                assert aggregation == expected, target["expr"]


def test_prometheus_scrapes_the_frontend_where_compose_runs_it() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    [target] = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    frontend = COMPOSE["services"][host]
    assert frontend["command"] == ["frontend"]
    assert frontend["ports"][0].endswith(f":{port}")
    prometheus = COMPOSE["services"]["prometheus"]
    # The key file the entrypoint writes is the one the scrape reads.
    assert job["authorization"]["credentials_file"] in prometheus["command"][0]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert mounted["/etc/prometheus/prometheus.yml"] == "./docker/monitoring/prometheus.yml"


def test_grafana_reads_that_prometheus_and_provisions_the_dashboard() -> None:
    grafana = COMPOSE["services"]["grafana"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    for source in mounted.values():
        assert (ROOT / source).is_file(), source
    [source] = yaml.safe_load((MONITORING / "grafana" / "datasources.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in COMPOSE["services"]
    [provider] = yaml.safe_load((MONITORING / "grafana" / "dashboards.yml").read_text())[
        "providers"
    ]
    dashboards = [t for t in mounted if t.startswith(provider["options"]["path"] + "/")]
    assert dashboards and grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] in (
        dashboards
    )
    dashboard = json.loads((MONITORING / "grafana" / "kvflow-dashboard.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


def test_monitoring_runs_only_when_asked() -> None:
    for name in ("prometheus", "grafana"):
        assert COMPOSE["services"][name]["profiles"] == ["monitoring"]
