"""The Grafana dashboard (``deploy/grafana/sluice-dashboard.json``) queries only metrics a real gateway exposes.

Every PromQL expression of every panel (and every ``label_values`` query of the template variables) is parsed into
the metric names it selects; each must be a series a live ``sluice serve`` (one sim worker, after some traffic)
exposes on ``/metrics``: a histogram ``X`` exposes ``X_bucket``, ``X_sum`` and ``X_count``; a summary ``X``,
``X_sum`` and ``X_count``; a counter its ``# TYPE`` name (``…_total`` with prometheus_client); a gauge ``X``.
Where the metric has samples, every label a selector matches on must be one of its labels.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import REPO_ROOT
from tests.gateway.sim_gateway import MODEL_NAME, sim_gateway

DASHBOARD_PATH = REPO_ROOT / "deploy" / "grafana" / "sluice-dashboard.json"

# PromQL words that are not metric names: aggregation operators (may be followed by `by (…)` instead of `(`),
# binary / set operators, modifiers. Functions are recognised by the `(` that follows them.
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                 "quantile", "limitk", "limit_ratio"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "atan2", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{(?P<matchers>[^}]*)\}")
_DURATION = re.compile(r"\b\d+(?:ms|[smhdwy])\b")
_NUMBER = re.compile(r"(?<![\w:.])(?:0x[0-9a-fA-F]+|\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<metric>[^,()]+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")
_NAME_MATCHER = re.compile(r'__name__\s*=\s*("(?:[^"\\]|\\.)*")')
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


def metric_names(expr: str) -> set[str]:
    """Return the metric names a PromQL expression selects (functions, operators, labels and numbers removed).

    Args:
        expr: a PromQL expression, possibly with Grafana variables (``$tier``, ``$__rate_interval``).
    """
    names = {json.loads(value) for value in _NAME_MATCHER.findall(expr)}  # {__name__="x"} selects a metric too
    text = _STRING.sub('""', expr)
    text = _SELECTOR.sub(lambda m: m.group("name") or "", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range vectors and subqueries
    text = _GROUPING.sub(" ", text)
    text = _VARIABLE.sub(" ", text)
    text = _DURATION.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    for match in _IDENTIFIER.finditer(text):
        word = match.group()
        if word.lower() in _KEYWORDS or word in _AGGREGATIONS:
            continue
        if text[match.end():].lstrip().startswith("("):
            continue  # a function call
        names.add(word)
    return names


def selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    """Return (metric name, label names its matchers use) for each ``name{…}`` selector of the expression."""
    out = []
    for match in _SELECTOR.finditer(_STRING.sub('""', expr)):
        if match.group("name"):
            labels = set(_MATCHER_LABEL.findall(match.group("matchers"))) - {"__name__"}
            out.append((match.group("name"), labels))
    return out


def dashboard_queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """Yield (where, PromQL) for every panel target and every ``label_values`` template variable."""
    def walk(panels: list[dict]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    yield f"panel {panel['title']!r} {target.get('refId', '')}", target["expr"]
            yield from walk(panel.get("panels", []))
    yield from walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = _LABEL_VALUES.match(query)
        if match is None:
            yield f"variable {variable['name']!r}", query
        elif match.group("metric"):
            yield f"variable {variable['name']!r}", match.group("metric")


def exposed_series(metrics_text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Parse Prometheus text format into (queryable series name → family, family → label names seen).

    A histogram ``X`` (``# TYPE X histogram``) makes ``X_bucket``, ``X_sum`` and ``X_count`` queryable, a summary
    ``X`` makes ``X``, ``X_sum`` and ``X_count``; counters and gauges their ``# TYPE`` name. Sample lines count too.
    """
    series: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            for suffix in suffixes.get(kind, ("",)):
                series[name + suffix] = name
        elif line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group()
            family = series.setdefault(name, name)
            found = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', line.split("}")[0] if "{" in line else ""))
            labels.setdefault(family, set()).update(found - {"le", "quantile"})
    return series, labels


# ----------------------------------------------------------------------------------------------- tests


def test_metric_names_parses_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, tier) '
                        '(rate(sluice_queue_time_seconds_bucket{tier=~"$tier"}[$__rate_interval])))') == {
        "sluice_queue_time_seconds_bucket"}
    assert metric_names('sum(rate(a_total{status=~"5.."}[5m] offset 1h)) / sum(rate(b_total[1m:10s]))') == {
        "a_total", "b_total"}
    assert metric_names("count(sluice_breaker_state == 2) or vector(0)") == {"sluice_breaker_state"}
    assert metric_names('{__name__="x_total", job="sum"} + 1e3 * y') == {"x_total", "y"}
    assert metric_names("max without (instance) (up) > bool 0.5") == {"up"}
    assert metric_names('topk(3, sum by (worker) (m1)) and on (worker) m2 unless ignoring (mode) m3') == {
        "m1", "m2", "m3"}
    assert selector_labels('rate(x_total{tier=~"$tier", reason!="a{b}"}[5m]) / y{worker="w"}') == [
        ("x_total", {"tier", "reason"}), ("y", {"worker"})]


def test_exposed_series_maps_suffixes_to_families():
    text = ("# HELP h_seconds H\n# TYPE h_seconds histogram\nh_seconds_bucket{le=\"1.0\",tier=\"vip\"} 1.0\n"
            "h_seconds_sum{tier=\"vip\"} 0.5\nh_seconds_count{tier=\"vip\"} 1.0\n"
            "# HELP c_total C\n# TYPE c_total counter\n# HELP g G\n# TYPE g gauge\ng{worker=\"w\"} 2.0\n")
    series, labels = exposed_series(text)
    assert series["h_seconds_bucket"] == series["h_seconds_count"] == "h_seconds"
    assert "h_seconds" not in series and "c" not in series and "c_total" in series and "g_count" not in series
    assert labels == {"h_seconds": {"tier"}, "g": {"worker"}}


def _run_one_job(base_url: str, timeout_s: float = 60.0) -> None:
    """Submit one small job (``POST /v1/jobs``) and wait until it succeeded (the job metrics get samples)."""
    body = json.dumps({"model": MODEL_NAME, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "Name a tea."}]}).encode()
    request = urllib.request.Request(base_url + "/v1/jobs", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        job_id = json.loads(response.read())["id"]
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{base_url}/v1/jobs/{job_id}", timeout=10) as response:
            status = json.loads(response.read())["status"]
        if status == "succeeded":
            return
        assert status in ("queued", "running") and time.monotonic() < deadline, status
        time.sleep(0.2)


@pytest.fixture(scope="module")
def metrics_text(tmp_path_factory) -> str:
    """``/metrics`` of a live sim gateway after a few streamed and plain completions."""
    with sim_gateway(tmp_path_factory.mktemp("grafana_server")) as server:
        for i in range(4):
            body = json.dumps({"model": MODEL_NAME, "max_tokens": 16, "stream": i % 2 == 0,
                               "messages": [{"role": "user", "content": f"hello {i}"}]}).encode()
            request = urllib.request.Request(server.base_url + "/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
        _run_one_job(server.base_url)
        server.wait_for_capacity(lambda c: c is not None and c["num_running"] == 0, timeout_s=10)
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as response:
            return response.read().decode()


def test_dashboard_is_grafana_json():
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    assert len(list(dashboard_queries(dashboard))) >= 20


def test_every_dashboard_metric_exists_on_metrics(metrics_text):
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    series, labels = exposed_series(metrics_text)
    missing, bad_labels = [], []
    for where, expr in dashboard_queries(dashboard):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        missing += [f"{where}: {name}" for name in sorted(names) if name not in series]
        for name, used in selector_labels(expr):
            family = series.get(name)
            if family in labels and not used <= labels[family]:
                bad_labels.append(f"{where}: {name} has labels {sorted(labels[family])}, not {sorted(used)}")
    assert not missing, "metrics the dashboard queries but /metrics lacks:\n" + "\n".join(missing)
    assert not bad_labels, "\n".join(bad_labels)


def test_dashboard_shows_jobs(metrics_text):
    dashboard = json.loads(DASHBOARD_PATH.read_text())
    queried = set().union(*(metric_names(expr) for _, expr in dashboard_queries(dashboard)))
    assert {"sluice_jobs", "sluice_jobs_finished_total", "sluice_jobs_oldest_queued_age_seconds"} <= queried
    series, labels = exposed_series(metrics_text)
    assert labels["sluice_jobs"] == {"status"} and labels["sluice_jobs_finished_total"] == {"status"}
    assert 'sluice_jobs_finished_total{status="succeeded"} 1.0' in metrics_text
