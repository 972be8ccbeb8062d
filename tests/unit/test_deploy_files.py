"""deploy/: every metric the Grafana dashboard and the Kubernetes examples query is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics.prometheus import PrometheusMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_NAME = re.compile(r"\btokenmill_[a-z0-9_]+\b")


def _exported_sample_names() -> set[str]:
    """Sample names of a real /metrics body (histograms give _bucket, _sum, _count)."""
    body = PrometheusMetrics("m").render()[0].decode()
    return {s.name for family in text_string_to_metric_families(body) for s in family.samples}


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_dashboard_expression_names_exported_metrics():
    exported = _exported_sample_names()
    exprs = _dashboard_expressions()
    assert len(exprs) >= 10
    for expr in exprs:
        names = METRIC_NAME.findall(expr)
        assert names, f"no tokenmill metric in {expr!r}"
        assert set(names) <= exported, (expr, set(names) - exported)


def test_kubernetes_examples_scale_on_the_token_load():
    exported = _exported_sample_names()
    for name in ("keda-scaledobject.yaml", "hpa.yaml"):
        text = (DEPLOY / "kubernetes" / name).read_text()
        assert {"tokenmill_kv_cache_tokens_used", "tokenmill_num_tokens_waiting"} <= set(
            METRIC_NAME.findall(text)) <= exported | {"tokenmill_token_demand"}
    keda = (DEPLOY / "kubernetes" / "keda-scaledobject.yaml").read_text()
    assert "sum(tokenmill_kv_cache_tokens_used + tokenmill_num_tokens_waiting)" in keda
