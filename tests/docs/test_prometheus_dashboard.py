"""deploy/grafana/asyncrl.json by structure (no Grafana package in Debian to import it into): a
dashboard Grafana imports as it is, its Prometheus a variable, one row per program and one of
vLLM's panels, every query naming only metrics the code exports or vLLM serves.
(tests/integration/test_prometheus_scrape.py runs every query against a real Prometheus.)"""

from __future__ import annotations

import re

from prometheus_names import dashboard, exported_names, expressions, names_in, rows


DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def test_importable_as_it_is():
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["datasource"] == DATASOURCE
    assert "__inputs" not in d  # nothing to fill in at import: the datasource is chosen on the page
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for panels in rows().values():
        for p in panels:
            assert p["datasource"] == DATASOURCE and p["targets"], p["title"]
            assert all(t["datasource"] == DATASOURCE for t in p["targets"]), p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_panels_do_not_overlap():
    taken = set()
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, p["title"]
        taken |= cells


def test_one_row_per_program_and_vllm():
    r = rows()
    assert list(r) == ["Overview", "Orchestrator", "Trainer", "Inference (asyncrl)", "vLLM"]
    for title, prefix in (("Orchestrator", "asyncrl_orchestrator_"), ("Trainer", "asyncrl_trainer_"),
                          ("Inference (asyncrl)", "asyncrl_inference_"), ("vLLM", "vllm:")):
        for p in r[title]:
            assert any(n.startswith(prefix) for t in p["targets"] for n in names_in(t["expr"])), (title, p["title"])
    titles = {p["title"] for panels in r.values() for p in panels}
    # What an operator looks at first (issue 64).
    assert {"Reward", "Held-out evaluation", "Step time and its split", "Staleness", "Weight update latency",
            "Programs up", "Servers in rotation", "Group outcomes per minute"} <= titles


def test_every_query_names_exported_metrics_of_the_chosen_run():
    exported = exported_names() | {"up"}  # Prometheus' own, per target
    for expr in expressions():
        named = names_in(expr)
        assert named and named <= exported, (expr, named - exported)
        # Every selector is narrowed to the runs picked on the page.
        selectors = re.findall(r"(?:asyncrl_\w+|vllm:[\w:]+|up)\{", expr)
        assert len(re.findall(r'run=~"\$run"', expr)) == len(selectors), expr
