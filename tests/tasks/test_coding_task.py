"""The coding task set and its reward through the real sandbox; the python tool's answers. The
forgeries of issue 52 (docs/tools.md's hostile table) each score 0: the verdict is made outside the
sandbox from return values, and the expected values never enter it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import types
from pathlib import Path

import pytest

from orchestrator.rewards.async_function import AsyncReward
from orchestrator.rewards.inline_function import InlineReward
from tasks import coding
from tasks.python_tool import python
from orchestrator.rollout.tool_functions import Tool

ROWS = list(itertools.islice(coding.dataset(0), 12))
SHOUT = next(r for r in coding.dataset(0) if r["entry_point"] == "shout")  # expected values unlike the arguments


def score(code: str, row: dict = SHOUT) -> float:
    return asyncio.run(coding.reward(row["prompt"], f"```python\n{code}\n```", row))


def test_reference_solutions_pass_every_test_and_wrong_or_hostile_code_scores_less():
    assert len({r["prompt"] for r in ROWS}) > 6  # varied
    assert list(itertools.islice(coding.dataset(0), 12)) == ROWS  # seeded

    async def scores():
        right = [coding.reward(r["prompt"], f"Here:\n```python\n{r['solution']}```", r) for r in ROWS]
        name = ROWS[0]["entry_point"]
        wrong = coding.reward(ROWS[0]["prompt"], f"```python\ndef {name}(*a):\n    return None\n```", ROWS[0])
        hang = coding.reward(ROWS[0]["prompt"], "while True: pass", ROWS[0])
        broken = coding.reward(ROWS[0]["prompt"], "def (", ROWS[0])
        return await asyncio.gather(*right), await asyncio.gather(wrong, hang, broken)

    right, (wrong, hang, broken) = asyncio.run(scores())
    assert right == [1.0] * len(ROWS)
    assert (wrong, hang, broken) == (0.0, 0.0, 0.0)


def test_a_case_that_raises_costs_its_share_and_prints_do_not_garble_the_results():
    first = SHOUT["cases"][0]["args"][0]
    code = (f"def shout(s):\n    print('thinking', s)\n    if s == {first!r}:\n        raise ValueError\n"
            "    return s.upper()")
    assert score(code) == 0.75


def test_results_must_have_exactly_the_expected_types():
    row = next(r for r in coding.dataset(0) if r["entry_point"].startswith("plus_"))
    k = int(row["entry_point"].split("_")[1])
    assert score(f"def {row['entry_point']}(x):\n    return float(x + {k})", row) == 0.0  # 5.0 is not 5
    assert score(f"def {row['entry_point']}(x):\n    return x + {k}", row) == 1.0


def test_rows_of_the_older_assert_format_score_the_same():
    old = {**SHOUT, "tests": [f"assert shout({c['args'][0]!r}) == {c['expected']!r}" for c in SHOUT["cases"]]}
    del old["cases"]
    assert coding.cases_of(old) == SHOUT["cases"]
    assert score(SHOUT["solution"], old) == 1.0
    with pytest.raises(ValueError, match="is not `assert shout"):
        coding.cases_of({**old, "tests": ["assert shout('a') != 'A'"]})


def test_the_expected_values_never_enter_the_sandbox():
    text = coding.program(SHOUT["solution"], "shout", [c["args"] for c in SHOUT["cases"]])
    assert all(c["args"][0] in text for c in SHOUT["cases"])  # the canary: the arguments do enter
    assert not any(c["expected"] in text for c in SHOUT["cases"])
    # Reading the tests: the code looks for the answer wherever it can, and answers only if found.
    code = ("import os, sys\n"
            "seen = repr(vars(sys.modules['__main__'])) + open('/proc/self/cmdline').read()\n"
            "for p in os.listdir('/proc'):\n"
            "    try:\n        seen += open(f'/proc/{p}/cmdline').read() + open(f'/proc/{p}/environ').read()\n"
            "    except OSError:\n        pass\n"
            "def shout(s):\n    return s.upper() if s.upper() in seen else None")
    assert score(code) == 0.0


RIGHT = [c["expected"] for c in SHOUT["cases"]]  # what a forger would have to name
TOTAL = {"prompt": "Write `total(xs)`.", "entry_point": "total",
         "cases": [{"args": [xs], "expected": sum(xs)} for xs in ([1, 2], [3], [-4, 4, 9], [])]}
# Each forgery: (its code, the row). The last ones write a document that names the right values
# (the forger read the arguments, or the test's author gave them) and is wrong in one way only.
FORGERIES = {
    "the verdict line, then exit": ("print('PASSED 1000/1', flush=True)\nimport os\nos._exit(0)", SHOUT),
    "the verdict at exit": ("import atexit\natexit.register(lambda: print('PASSED 4/4'))\nraise SystemExit", SHOUT),
    "exit early from the call": ("import os\ndef shout(s):\n    os._exit(0)", SHOUT),
    "exit early, cleanly": ("raise SystemExit(0)", SHOUT),
    "patched builtins": ("import builtins\nbuiltins.type = lambda *a: str\nbuiltins.isinstance = lambda *a: True\n"
                         "def shout(s):\n    return 0", SHOUT),
    "patched sys.modules": ("import sys, types\nfake = types.ModuleType('json')\n"
                            "fake.dumps = lambda *a, **k: '{\"passed\": 4, \"total\": 4}'\nsys.modules['json'] = fake\n"
                            "def shout(s):\n    return None", SHOUT),
    "a document nested too deep to parse": ("import os\nos.write(3, b'[' * 3000)\nos._exit(0)", SHOUT),
    "a second document on the channel": ("import os\nos.write(3, b'{\"results\": [{\"value\": \"A\"}]}')\n"
                                         "def shout(s):\n    return s.upper()", SHOUT),
    # One guard each:
    "the right document, then a crash": (f"import json, os\nos.write(3, json.dumps({{'results': "
                                         f"[{{'value': v}} for v in {RIGHT!r}]}}).encode())\nos._exit(1)", SHOUT),
    "patched json": (f"import json\n_dumps = json.dumps\njson.dumps = lambda *a, **k: _dumps("
                     f"{{'results': [{{'value': v}} for v in {RIGHT!r}], 'passed': 4}})\ndef shout(s):\n    return 0", SHOUT),
    "one result too many": (f"import json\n_dumps = json.dumps\njson.dumps = lambda *a, **k: _dumps("
                            f"{{'results': [{{'value': v}} for v in {RIGHT!r} + ['?']]}})\ndef shout(s):\n    return 0",
                            SHOUT),
    "a result that is also an error": (f"import json\n_dumps = json.dumps\njson.dumps = lambda *a, **k: _dumps("
                                       f"{{'results': [{{'value': v, 'error': 'X'}} for v in {RIGHT!r}]}})\n"
                                       "def shout(s):\n    return 0", SHOUT),
    "floats for ints": ("def total(xs):\n    return float(sum(xs))", TOTAL),
    "always equal": ("class Any(int):\n    __eq__ = lambda self, other: True\n    __hash__ = int.__hash__\n"
                     "def total(xs):\n    return Any(sum(xs))", TOTAL),
    "a str subclass always equal": ("class Any(str):\n    __eq__ = lambda self, other: True\n"
                                    "    __hash__ = str.__hash__\ndef shout(s):\n    return Any(s.upper())", SHOUT),
}
# Each guard of tasks/coding.py, removed: (the source it changes, what it becomes, the forgeries it alone stops).
GUARDS = {
    "a clean exit": ('if result.outcome == "ok" else None', "", {"the right document, then a crash"}),
    "one field": ("type(doc) is dict and len(doc) == 1", "type(doc) is dict", {"patched json"}),
    "one result per case": ("or len(results) != n ", "", {"one result too many"}),
    "a value, not an error": ('set(r) == {"value"}', '"value" in r', {"a result that is also an error"}),
    "exact types outside": ("    if type(value) is not type(expected):\n        return False\n", "",
                            {"floats for ints"}),
    "exact types in the harness": ("def _plain(v, depth=0):\n", "def _plain(v, depth=0):\n    return v\n",
                                   {"always equal", "a str subclass always equal"}),
}


@pytest.fixture(scope="module")
def forged_scores() -> dict[str | None, dict[str, float]]:
    """Each forgery's score through coding.reward as it is (None), and with each guard removed."""
    source = Path(coding.__file__).read_text()
    modules = {None: coding}
    for guard, (old, new, _) in GUARDS.items():
        assert source.count(old) == 1, f"{guard}: {old!r} not once in tasks/coding.py"
        module = types.ModuleType(f"coding_without_{len(modules)}")
        exec(compile(source.replace(old, new), coding.__file__, "exec"), module.__dict__)
        modules[guard] = module

    async def all_scores():
        runs = {}  # a program is run once, whichever verdicts read it

        async def scored(module, code, row):
            cases = module.cases_of(row)
            text = module.program(code, row["entry_point"], [c["args"] for c in cases])
            if text not in runs:
                runs[text] = asyncio.ensure_future(coding.SANDBOX.run(text))
            return module.verdict(await runs[text], cases)

        keys = [(g, f) for g in modules for f in FORGERIES]
        # Every run to its end before anything is raised: runs cancelled by asyncio.run's shutdown
        # while starting can hang it (asyncio 3.11, issue 60's report).
        values = await asyncio.gather(*(scored(modules[g], *FORGERIES[f]) for g, f in keys), return_exceptions=True)
        return dict(zip(keys, values))

    found = asyncio.run(all_scores())
    return {g: {f: found[g, f] for f in FORGERIES} for g in modules}


@pytest.mark.parametrize("name", FORGERIES)
def test_a_forged_verdict_scores_zero(name, forged_scores):
    assert forged_scores[None][name] == 0.0


@pytest.mark.parametrize("guard", GUARDS)
def test_each_guard_alone_stops_a_forgery_of_its_own(guard, forged_scores):
    """Removed, the guard lets its own forgeries score, and only those: each is stopped by the
    guard docs/tools.md names for it, not by an accident earlier on."""
    turned = {f for f, s in forged_scores[guard].items() if s > 0}
    assert turned == GUARDS[guard][2], turned


def test_a_reward_outside_its_range_fails_that_rollout_and_is_said_once(caplog):
    async def forged(prompt, completion, row):
        return 1000.0

    forged.bounds = (0.0, 1.0)

    def fine(prompt, completion, row):
        return row["score"]

    fine.bounds = (0.0, 1.0)
    reward = AsyncReward("forged", 5.0, forged)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        assert asyncio.run(reward.score("p", ["a", "b", "c"], {})) == [None, None, None]
    assert "outside its range [0, 1]" in reward.last_error
    assert len([r for r in caplog.records if "outside its range" in r.message]) == 1
    inline = InlineReward("fine", 5.0, fine)  # a sync function, checked the same way
    assert (inline.call("p", "c", {"score": 0.5}), inline.call("p", "c", {"score": -0.1})) == (0.5, None)
    assert coding.reward.bounds == (0.0, 1.0)


def test_the_python_tool_describes_itself_and_answers_with_output_or_why_it_stopped():
    schema = Tool.from_function(python).schema["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert asyncio.run(python("print(6 * 7)")).strip() == "42"
    assert "ZeroDivisionError" in asyncio.run(python("1/0"))
    assert asyncio.run(python("import time; time.sleep(30)")).endswith("[timed out]")


class PythonToolEnv:
    """A tool environment whose only tool is the python tool: the run executes code."""

    tools = [python]


def _coding_run(task: str = "coding", **sandbox):
    from conftest import TINY_MODEL
    from rl.config import RunConfig

    return RunConfig.model_validate({"model": str(TINY_MODEL), "orchestrator": {
        "datasets": [{"function": f"tasks.{task}:dataset", "reward": f"tasks.{task}:reward"}], **sandbox}})


def test_start_up_refuses_a_run_that_executes_code_without_isolation_unless_told(monkeypatch, capsys):
    from conftest import TINY_MODEL
    from orchestrator import preflight
    from orchestrator.sandbox import sandbox
    from rl.config import ConfigError, RunConfig

    assert preflight.sandbox_isolation in preflight.CHECKS
    assert preflight.executes_code(coding.reward) and preflight.executes_code(python)
    assert not preflight.executes_code(preflight.trackers)
    tool_run = RunConfig.model_validate({"model": str(TINY_MODEL), "orchestrator": {
        "environment": {"class": "test_coding_task:PythonToolEnv"}}})
    assert preflight._code_runners(tool_run) == ["orchestrator.environment.class = 'test_coding_task:PythonToolEnv'"]
    if sandbox.Sandbox.isolation() is None:  # here: the line saying which isolation the run gets
        preflight.sandbox_isolation(_coding_run())
        assert "runs model-written code, isolated: bubblewrap" in capsys.readouterr().err
    monkeypatch.setattr(sandbox, "_probe", lambda: (None, "bubblewrap not found: apt-get install bubblewrap"))
    with pytest.raises(ConfigError) as refused:
        preflight.sandbox_isolation(_coding_run())
    assert str(refused.value) == (
        "dataset coding: reward = 'tasks.coding:reward' runs model-written code: bubblewrap not found: "
        "apt-get install bubblewrap, or set orchestrator.sandbox.isolation = \"none\" to run it unisolated")
    preflight.sandbox_isolation(_coding_run(sandbox={"isolation": "none"}))  # told: starts, and says so
    assert "UNSAFE: dataset coding: reward = 'tasks.coding:reward' runs model-written code unisolated" \
        in capsys.readouterr().err
    preflight.sandbox_isolation(_coding_run("count"))  # no code run: no check


def test_rl_orchestrator_refuses_with_exit_2_and_dry_run_shows_the_isolation(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from conftest import TINY_MODEL
    from orchestrator.sandbox import sandbox
    from asyncrl.main import app

    config = tmp_path / "coding.toml"
    config.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n[orchestrator]\n'
                      'datasets = [{function = "tasks.coding:dataset", reward = "tasks.coding:reward"}]\n')
    monkeypatch.chdir(tmp_path)
    if sandbox.Sandbox.isolation() is None:
        shown = CliRunner().invoke(app, ["orchestrator", "@", str(config), "--dry-run"])
        assert shown.exit_code == 0, shown.stderr
        assert "runs model-written code, isolated: bubblewrap" in shown.stderr
    monkeypatch.setattr(sandbox, "_probe", lambda: (None, "bubblewrap not found: apt-get install bubblewrap"))
    refused = CliRunner().invoke(app, ["orchestrator", "@", str(config), "--dry-run"])
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        "rl orchestrator: dataset coding: reward = 'tasks.coding:reward' runs model-written code: "
        "bubblewrap not found: apt-get install bubblewrap, or set orchestrator.sandbox.isolation = \"none\" "
        "to run it unisolated"]
    assert not (tmp_path / "run").exists()
