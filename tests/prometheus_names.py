"""The metric names asyncrl's Prometheus pieces may use: every name a scrape of the three programs
can show (ours from docs/observability.md's generator, scripts/metrics_doc.py, and vLLM's from
its stat logger's source), the names a PromQL expression reads, and the expressions of the
Grafana dashboard. Shared by the metrics, alert-rule, dashboard and real-scrape tests."""

from __future__ import annotations

import json
import re
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import metrics_doc  # noqa: E402


VLLM_LOGGERS = next((ROOT / ".venv" / "lib").glob("python3*/site-packages/vllm/v1/metrics/loggers.py"))


def vllm_names() -> set[str]:
    """The metric names vLLM's own /metrics serves (its Prometheus stat logger's source)."""
    names = set(re.findall(r'name="(vllm:[a-z0-9_:]+)"', VLLM_LOGGERS.read_text()))
    return {n + s for n in names for s in ("", "_total", "_bucket", "_sum", "_count")}


def exported_names() -> set[str]:
    """Every name a scrape of the three programs can show (asyncrl's and vLLM's)."""
    ours = {shown for _, name, kind, _, _ in metrics_doc.metrics() for shown in metrics_doc.exposed(name, kind)}
    return ours | vllm_names()


def names_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    return set(re.findall(r"(?<![\w:])(asyncrl_\w+|vllm:[\w:]+|up)(?![\w:(])", expr))


DASHBOARD = ROOT / "deploy" / "grafana" / "asyncrl.json"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def rows() -> dict[str, list[dict]]:
    """Each row's title: the panels under it."""
    out: dict[str, list[dict]] = {}
    current = None
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], [])
        else:
            assert current is not None, f"{panel['title']}: above every row"
            current.append(panel)
    return out


def expressions() -> list[str]:
    return [t["expr"] for panels in rows().values() for p in panels for t in p["targets"]]
