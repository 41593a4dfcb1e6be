"""The sglang:dsv4_* metrics: the dashboard plots only what exists, and every fix's collector is declared."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dsv4_sm120 import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "dsv4_sm120_dashboard.json"


def test_every_metric_the_dashboard_plots_exists():
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    plotted = {m for e in exprs for m in re.findall(r"sglang:dsv4_\w+", e)}
    assert plotted, "the dashboard plots nothing"
    assert plotted <= metrics.exposed_names(), plotted - metrics.exposed_names()
    assert metrics.exposed_names() <= plotted, f"not on the dashboard: {metrics.exposed_names() - plotted}"


def test_counters_are_named_like_upstreams():
    for name, spec in metrics.SPECS.items():
        assert re.fullmatch(r"[a-z0-9_]+", name), name
        assert name.endswith("_total") == (spec[0] == "counter"), name


def test_without_enable_every_call_is_a_no_op():
    metrics.inc("nixl_frames_served_total")
    metrics.inc("nixl_frames_rejected_total", reason="unknown tag")
    metrics.sample_once()
    assert not metrics._metrics
