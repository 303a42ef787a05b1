"""examples/grafana/corectl-dashboard.json queries only what `GET /metrics` exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

from corectl.engine.messages import SchedulerStats
from corectl.server.http.metrics import ServerMetrics
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "corectl-dashboard.json"
METRIC = re.compile(r"vllm:[A-Za-z0-9_:]+")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every sample name the server's registry renders, with the labels it carries."""
    text = ServerMetrics("m", 512, lambda: [SchedulerStats()]).render().decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def queries(dashboard: dict) -> list[str]:
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def test_every_expression_names_exported_metrics_and_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    metrics = exported()
    expressions = queries(dashboard)
    assert len(expressions) > len(dashboard["panels"])
    for expr in expressions:
        names = METRIC.findall(expr)
        assert names, f"no corectl metric in {expr!r}"
        unknown = [name for name in names if name not in metrics]
        assert not unknown, f"{expr!r} queries {unknown}, which /metrics does not export"
        for group in GROUPING.findall(expr):
            for label in (part.strip() for part in group.split(",")):
                assert all(label in metrics[name] for name in names), f"{expr!r}: no label {label!r}"
        if "$model_name" in expr:
            assert all("model_name" in metrics[name] for name in names)


def test_panels_are_laid_out_and_referenced_uniquely():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(cells) == len(panels)
    for panel in panels:
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids)
