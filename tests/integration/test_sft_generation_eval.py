"""sft.eval_generate: `rl sft` evaluates by generation as it trains, with a real vLLM server of its
own (`rl eval --follow`): records for step 0, every eval_every steps and the last in
metrics.jsonl, equal to what `rl eval` gives on the same published weights; refused at start-up
without eval datasets; nothing left running when rl sft dies."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import free_port, rl_command
from sft_runs import CHAT_MODEL, config, records, sft

pytestmark = pytest.mark.slow

BODY = """[trainer.optim]
lr = 1e-4
[inference]
dtype = "float32"
[sft]
batch_size = 16
eval_every = 2
eval_generate = true
[[sft.datasets]]
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 3, max_word_len = 7 }}
seed = 1000000
size = 200
completion_key = "answer"
[[sft.eval_datasets]]
name = "heldout"
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 3, max_word_len = 7 }}
seed = 10000
size = 20
completion_key = "answer"
[orchestrator.sampling]
max_tokens = 10
[orchestrator.eval]
rows = {rows}
[[orchestrator.eval.datasets]]
name = "heldout"
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 3, max_word_len = 7 }}
seed = 10000
"""


def generation_records(run: Path) -> list[dict]:
    return [r for r in records(run, "eval") if "eval/heldout/accuracy" in r]


def test_each_evaluated_step_is_scored_by_generation_as_rl_eval_scores_it(tmp_path):
    cfg = config(tmp_path, BODY.format(rows=20), model=CHAT_MODEL, steps=4)
    port = str(free_port())
    result = sft(cfg, "--inference.port", port)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    generated = generation_records(run)
    assert [r["step"] for r in generated] == [0, 2, 4], generated
    assert all(r["eval/heldout/rows"] == 20 and 0 <= r["eval/heldout/accuracy"] <= 1 for r in generated)
    # The held-out loss is still measured at the same steps, by the trainer.
    assert [r["step"] for r in records(run, "eval") if "eval/loss" in r] == [0, 2, 4]
    # The versions were published for it (eval_every) and the follower's scratch server is gone.
    assert (run / "weights" / "step_4" / "STABLE").exists()
    assert not list((run / "eval").glob("server-*")), list((run / "eval").iterdir())
    assert "step 4: heldout/reward" in (run / "logs" / "eval.log").read_text()
    # Greedy: `rl eval` of the last published weights gives the numbers the follower recorded.
    again = subprocess.run(rl_command("eval", "@", str(cfg), "--inference.port", port, "--step", "4"),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"heldout/accuracy: {generated[-1]['eval/heldout/accuracy']:.4f}" in again.stdout, again.stdout


def test_eval_generate_without_eval_datasets_exits_2_at_start_up(tmp_path):
    body = BODY.format(rows=20).split("[orchestrator.eval]")[0]
    result = sft(config(tmp_path, body, model=CHAT_MODEL, steps=2))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sft.eval_generate = true but [[orchestrator.eval.datasets]] is empty" in lines[0]
    assert not (tmp_path / "run" / "weights").exists()  # nothing started


def test_a_killed_rl_sft_leaves_no_evaluator_or_server_behind(tmp_path):
    """rl sft SIGKILLed while its follower's server is up (step 0 evaluated, training going on):
    the follower, told by PR_SET_PDEATHSIG (or seeing its parent gone), stops its server and exits."""
    # 2 rows: only that step 0 was evaluated matters here, not its numbers.
    cfg = config(tmp_path, BODY.format(rows=2), model=CHAT_MODEL, steps=100000)
    log = tmp_path / "run" / "logs" / "eval.log"
    with open(tmp_path / "sft.log", "wb") as out:
        proc = subprocess.Popen(rl_command("sft", "@", str(cfg), "--inference.port", str(free_port())),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300  # the server's start, one evaluation
        while time.monotonic() < deadline and not (log.exists() and "step 0: heldout" in log.read_text()):
            assert proc.poll() is None, (tmp_path / "sft.log").read_text()[-3000:]
            time.sleep(1)
        assert "step 0: heldout" in log.read_text(), log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    said = (tmp_path / "sft.log").read_text()
    follower = int(re.search(r"generation evaluation on \[orchestrator.eval\] started \(pid (\d+)", said)[1])
    scratch = f"{tmp_path / 'run' / 'eval'}/server-{follower}"
    assert started_with(scratch), "the follower's server should be up"
    deadline = time.monotonic() + 120  # its stop: SIGTERM, then SIGKILL after 30 s
    while time.monotonic() < deadline and (alive(follower) or started_with(scratch)):
        time.sleep(1)
    assert not alive(follower), "the follower outlived rl sft"
    assert not started_with(scratch), "the follower's server outlived it"
    assert "rl eval: stopped" in log.read_text() or "the process that started it is gone" in log.read_text()


def test_an_evaluator_that_dies_is_named_in_one_line_and_training_goes_on(tmp_path):
    """The follower SIGKILLed after recording step 0 (a crash point): rl sft says so once, trains
    to the end, exits 0; the follower's server dies with it (PR_SET_PDEATHSIG)."""
    # 2 rows: only that step 0 was recorded matters here, not its numbers.
    cfg = config(tmp_path, BODY.format(rows=2), model=CHAT_MODEL, steps=4)
    result = sft(cfg, "--inference.port", str(free_port()), env={"ASYNCRL_CRASH_AT": "eval.recorded:0"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "the generation evaluation exited" in line]
    assert len(lines) == 1 and "exited with code -9" in lines[0] and "training goes on" in lines[0], lines
    run = tmp_path / "run"
    assert [r["step"] for r in records(run, "trainer")] == [1, 2, 3, 4]
    assert [r["step"] for r in generation_records(run)] == [0]
    follower = int(re.search(r"started \(pid (\d+)", result.stderr)[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and started_with(f"{run / 'eval'}/server-{follower}"):
        time.sleep(1)
    assert not started_with(f"{run / 'eval'}/server-{follower}"), "the dead follower's server is still running"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def started_with(text: str) -> list[int]:
    """Live processes whose command line holds `text`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                if text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") and alive(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found
