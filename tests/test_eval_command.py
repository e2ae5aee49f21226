"""`rl eval` (orchestrator/eval_command.py) on real vLLM: a model and the same weights published as
a run's weights/step_1 give the same greedy numbers; what it measured lands in evals.jsonl; weights
that were never published are refused (exit 2)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from conftest import ROOT, free_port, rl_command

pytestmark = pytest.mark.slow

CHAT_MODEL = ROOT / "models" / "tiny-chat"


def test_rl_eval_gives_the_same_greedy_numbers_for_the_same_weights(tmp_path):
    run = tmp_path / "run"
    published = run / "weights" / "step_1"
    shutil.copytree(CHAT_MODEL, published)
    (published / "STABLE").touch()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'''model = "{CHAT_MODEL}"
output_dir = "{run}"
seq_len = 64
[inference]
port = {free_port()}
dtype = "float32"
[orchestrator]
max_tokens = 10
[orchestrator.eval]
rows = 30
[[orchestrator.eval.datasets]]
name = "heldout"
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 3, max_word_len = 7 }}
seed = 10000
''')
    outputs = []
    for extra in ([], ["--step", "1"]):
        result = subprocess.run(rl_command("eval", "@", str(cfg), *extra), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1] and "heldout/accuracy: " in outputs[0]
    records = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [(r["step"], r["weights"]) for r in records] == [(0, str(CHAT_MODEL)), (1, str(published))]
    assert records[0]["eval/heldout/rows"] == 30 and 0 <= records[0]["eval/heldout/accuracy"] <= 1
    assert {k: v for k, v in records[0].items() if k.startswith("eval/")} == \
        {k: v for k, v in records[1].items() if k.startswith("eval/")}

    never = subprocess.run(rl_command("eval", "@", str(cfg), "--step", "2"), capture_output=True, text=True,
                           timeout=60)
    assert never.returncode == 2 and "--step 2: " in never.stderr and "no STABLE" in never.stderr
