"""The observability pack (deploy/observability/) against what live processes export: every
metric the dashboard and the alert rules name is one a running node or ``kvstore serve``
exports (scraped, not listed by hand), none exports ``_created`` series, the rules pass
``promtool check rules`` and their unit tests, and the PrometheusRule is the rules file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from client import SyncKVClient
from deploy.local_cluster import LocalCluster
from tests.kvstore.node_harness import NodeProcess, free_port, write_config

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / "deploy" / "observability"
RULES = PACK / "kvstore-rules.yaml"
# Series Prometheus makes itself, not the targets: `up` (did the scrape answer).
PROMETHEUS_OWN = {"up"}
_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _expressions() -> list[str]:
    """Every PromQL expression of the dashboard and of the alert rules."""
    dashboard = json.loads((PACK / "kvstore-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    rules = yaml.safe_load(RULES.read_text())
    return exprs + [r["expr"] for g in rules["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels left out)."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values, strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    names = {
        m.group()
        for m in re.finditer(r"(?<![\w$.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
        if not expr[m.end() :].lstrip().startswith("(")  # a function, not a metric
    }
    return {n for n in names if n.lower() not in _PROMQL_WORDS}


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page can hold, from its families (empty ones included)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


def created_series(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^[^#]\S*_created[{ ]", line)]


def _scrape(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.read().decode()


def test_the_expression_parser_finds_names_and_only_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, rpc) (rate(kvstore_request_seconds_bucket{rpc=~"A|B"}'
        "[$__rate_interval]))) / on (rpc) group_left kvstore:x_total > bool 1 and vllm:y offset 5m"
    )
    assert metric_names(expr) == {"kvstore_request_seconds_bucket", "kvstore:x_total", "vllm:y"}


def test_the_prometheus_rule_is_the_rules_file() -> None:
    (rule,) = [d for d in yaml.safe_load_all((PACK / "prometheusrule.yaml").read_text()) if d]
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"], (
        "prometheusrule.yaml drifted from kvstore-rules.yaml: copy the groups over"
    )


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool is not installed: Debian's prometheus package has it "
            "(`make system-packages` as root installs it)"
        )
    return path


def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = _promtool()
    for command in (["check", "rules", str(RULES)], ["test", "rules", "kvstore-rules.test.yaml"]):
        result = subprocess.run(
            [promtool, *command], cwd=PACK, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"promtool {' '.join(command)}:\n{result.stdout}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("observed")
    with LocalCluster.start(root, 12, fsync=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def node_metrics(cluster: LocalCluster) -> str:
    """One node's /metrics after a tenant wrote and read (its labelled series exist)."""
    with SyncKVClient.connect(cluster.cluster_toml, "acme") as kv:
        kv.put("observed", b"x" * 4096)
        assert kv.get("observed") == b"x" * 4096
    node = cluster.config.nodes[0]
    return _scrape(f"http://{node.host}:{node.metrics_port}/metrics")


def test_nodes_export_no_created_series(node_metrics: str) -> None:
    assert created_series(node_metrics) == [], "a node exports _created series"
    assert 'kvstore_tenant_reads_total{outcome="hit",tenant="acme"}' in node_metrics


def test_every_store_metric_named_is_exported(node_metrics: str) -> None:
    names = set().union(*(metric_names(e) for e in _expressions()))
    store_names = {n for n in names if ":" not in n}  # vllm:*, kvstore:* are the serving tier's
    missing = store_names - exported_names(node_metrics) - PROMETHEUS_OWN
    assert not missing, f"the dashboard or rules name metrics no node exports: {sorted(missing)}"


def sampled_names(text: str) -> set[str]:
    """The series names a /metrics page holds at least one sample of."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_fresh_node_has_every_series_the_dashboard_and_rules_read(tmp_path: Path) -> None:
    """Scraped before any request: a series that appears only once something happened leaves
    a dashboard panel empty and an alert unable to fire on a new node."""
    names = set().union(*(metric_names(e) for e in _expressions()))
    store_names = {n for n in names if ":" not in n} - PROMETHEUS_OWN
    port = free_port()
    node = NodeProcess(write_config(tmp_path, metrics_port=port)).start()
    try:
        text = _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        node.stop()
    missing = store_names - sampled_names(text)
    assert not missing, f"a fresh node has no series of: {sorted(missing)}"
    assert 'kvstore_class_youngest_evicted_age_seconds{traffic_class="agent"} +Inf' in text


@pytest.mark.slow
def test_every_serving_metric_named_is_exported(cluster: LocalCluster, tmp_path: Path) -> None:
    from tests.engine_adapter.serving.conftest import start_serve  # the serving tests' harness

    serving_names = {n for e in _expressions() for n in metric_names(e) if ":" in n}
    proc, ports, _ = start_serve(cluster.cluster_toml, tmp_path, "--model", "random:small")
    try:
        text = _scrape(f"http://127.0.0.1:{ports['http']}/metrics")
    finally:
        proc.terminate()
        proc.wait(60)
    assert created_series(text) == [], "kvstore serve exports _created series"
    missing = serving_names - exported_names(text)
    assert not missing, f"the dashboard or rules name metrics serve lacks: {sorted(missing)}"
