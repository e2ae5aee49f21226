"""[[orchestrator.eval.environments]]: held-out episodes of environments, with `rl eval` and a
real vLLM server: the calculator task played by the built-in tool loop and by an agent written
against the official OpenAI client gives the same greedy accuracy on the same rows, with the
episodes' turns and tool calls beside it; bad environments are refused at start-up."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, free_port, rl_command

pytestmark = pytest.mark.slow

CONFIG = """model = "{model}"
output_dir = "{out}"
seq_len = 256
[inference]
port = {port}
dtype = "float32"
[orchestrator]
tools.parser = "hermes"
sampling.max_tokens = 64
[orchestrator.eval]
rows = 12
[[orchestrator.eval.environments]]
name = "builtin"
class = "tasks.calculator:Calculator"
max_turns = 3
[[orchestrator.eval.environments]]
name = "agent"
class = "{agent}"
max_turns = 3
"""


def write(tmp_path, agent="tasks.calculator_agent:CalculatorAgent"):
    cfg = tmp_path / "eval.toml"
    cfg.write_text(CONFIG.format(model=ROOT / "models" / "tiny-tool", out=tmp_path / "run", port=free_port(), agent=agent))
    return cfg


def test_the_builtin_loop_and_an_openai_client_agent_score_alike(tmp_path):
    result = subprocess.run(rl_command("eval", "@", str(write(tmp_path))), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [record] = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    for name in ("builtin", "agent"):
        assert record[f"eval/{name}/rows"] == 12 and record[f"eval/{name}/failed"] == 0, record
        assert record[f"eval/{name}/turns"] > 1, record  # the model called the tool, then answered
    assert record["eval/builtin/tool_calls"] > 0
    # Greedy, the same prompts rendered by the same template: the same answers.
    assert record["eval/agent/accuracy"] == record["eval/builtin/accuracy"] > 0, record
    assert "agent/accuracy: " in result.stdout and "HTTP Request" not in result.stderr


def test_an_environment_that_does_not_load_is_refused_at_start_up(tmp_path):
    result = subprocess.run(rl_command("eval", "@", str(write(tmp_path, agent="no_such_module:Agent"))),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl eval: orchestrator.eval.environments agent: class"), lines
