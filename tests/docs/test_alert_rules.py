"""deploy/prometheus/asyncrl_rules.yml against promtool (Debian's prometheus package, `make
install`): the rules load, each has `for:` and a summary naming its program, and
asyncrl_rules_test.yml's series fire each alert and leave it quiet where they should. That the
tests pin each rule: with any one rule's expression replaced by one that always fires, or one
that never does, promtool's tests fail. Every metric the rules name is one the code exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from prometheus_names import exported_names, names_in


RULES = ROOT / "deploy" / "prometheus" / "asyncrl_rules.yml"
TESTS = RULES.with_name("asyncrl_rules_test.yml")
PROGRAMS = ("trainer", "orchestrator", "inference", "{{ $labels.program }}")

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool missing: make install (apt-get install prometheus)")


def rules() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"][0]["rules"]


def promtool_test(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", "test", "rules", str(folder / TESTS.name)], capture_output=True, text=True,
                          timeout=120)


def test_each_rule_waits_and_names_its_program():
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) == 10, names
    for rule in rules():
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
        summary = rule["annotations"]["summary"]
        assert "\n" not in summary and summary.startswith(PROGRAMS), rule


def test_rules_name_only_exported_metrics():
    named = set().union(*(names_in(r["expr"]) for r in rules()))
    assert named - {"up"} <= exported_names(), named - {"up"} - exported_names()


def test_each_rule_has_firing_and_quiet_cases():
    cases = yaml.safe_load(TESTS.read_text())["tests"]
    for name in (r["alert"] for r in rules()):
        checks = [c for t in cases for c in t["alert_rule_test"] if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in checks), f"{name}: no case where it fires"
        assert any(not c["exp_alerts"] for c in checks), f"{name}: no case where it stays quiet"


@needs_promtool
def test_promtool_checks_and_tests_the_rules():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS: 10 rules found" in check.stdout, check.stdout + check.stderr
    result = promtool_test(RULES.parent)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("replacement", ["vector(1)", "vector(0) > 1"], ids=["always", "never"])
def test_the_cases_catch_a_broken_rule(tmp_path, replacement):
    """Each rule in turn replaced: promtool's tests must fail, naming that alert."""
    shutil.copy(TESTS, tmp_path / TESTS.name)
    for index, rule in enumerate(rules()):
        doc = yaml.safe_load(RULES.read_text())
        doc["groups"][0]["rules"][index]["expr"] = replacement
        (tmp_path / RULES.name).write_text(yaml.safe_dump(doc))
        result = promtool_test(tmp_path)
        caught = result.returncode != 0 and f"alertname: {rule['alert']}," in result.stdout + result.stderr
        assert caught, (rule["alert"], result.stdout, result.stderr)
