"""No run that spins (docs/reliability.md): a config whose rows or groups can only come to nothing
ends with one line naming the culprit, why and the fix, instead of drawing rows forever.

- At start-up (rl/prompt_fit.py): prompts that leave no room for max_tokens within seq_len are
  refused by `rl orchestrator` / `rl run`, exit 2, before any engine starts.
- At run time (orchestrator/streaks.py): rows skipped, groups filtered or failed
  orchestrator.max_futile_streak times in a row, or no server in rotation for
  server_wait_timeout_s, stop `rl orchestrator` with one ERROR line and exit 1; the last
  checkpoint accounts for every row drawn (batched, pending, or skipped for being too long).

The run-time stops run the real `rl orchestrator` against the stand-in server of
tests/fake_inference.py (as its own process: `python tests/fake_inference.py PORT`), which a test
can kill; rows skipped at run time are also shown on a real vLLM engine under `rl run`
(test_rl_run_on_a_real_engine_stops_a_dataset_whose_later_rows_are_too_long).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL, free_port, rl_command
from orchestrator.prompts import decode_state
from rl.batch import Batch
from rl.rundir import RunDir

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
GOOD_ROWS = 64  # the start-up check measures the first 64 rows: those are short, the later ones long
STREAK = 20

ROWS = f'''
from fake_inference import row_name


def rows(seed):
    """Rows 0..{GOOD_ROWS - 1} fit seq_len 64; later ones do not (100 letters)."""
    i = 0
    while True:
        yield {{"prompt": row_name(i) + ("" if i < {GOOD_ROWS} else "a" * 100) + "="}}
        i += 1


def zero(prompt, completion, row):
    return 0.0


def broken(prompt, completion, row):
    raise ValueError("no answer in this row")
'''


def orchestrator_config(tmp: Path, url: str, async_level: int = 1, **orchestrator) -> Path:
    """`async_level`: max_async_level (no trainer runs: batches 1..async_level+1 go out, then the
    orchestrator waits for version 1)."""
    (tmp / "spin_rows.py").write_text(ROWS)
    keys = {"server_urls": [url], "discover_servers": False, "dataset": "spin_rows:rows",
            "reward": "fake_inference:reward", "prompts_per_step": 4, "group_size": 2, "max_in_flight_groups": 8,
            "max_tokens": 6, "max_futile_streak": STREAK, "trainer_timeout_s": 300, **orchestrator}
    lines = [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    path = tmp / "cfg.toml"
    path.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp / "run"}"\nseq_len = 64\nmax_steps = 40\n'
                    f"max_async_level = {async_level}\n[orchestrator]\n" + "\n".join(lines) + "\n")
    return path


def env_with_tests() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


class StandIn:
    """tests/fake_inference.py's null server as its own process (instant generation)."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "fake_inference.py"), str(self.port)],
                                     env=env_with_tests(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError("the stand-in server did not come up within 60 s")
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.kill()


def run_orchestrator(cfg: Path, cwd: Path, limit_s: float = 180, on_line=None) -> tuple[list[str], int]:
    """Its output lines and exit code; `on_line(line)` sees each line as it comes."""
    proc = subprocess.Popen(rl_command("orchestrator", "@", str(cfg)), cwd=cwd, env=env_with_tests(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=10)
        raise AssertionError("the orchestrator outlived its limit (it spins):\n" + "\n".join(lines[-30:])) from None
    reader.join(timeout=10)
    return lines, code


def the_error(lines: list[str]) -> str:
    """The one line that stopped the run: the last error, said once (a prompt dropped after three
    failed groups is an error line of its own, before it)."""
    errors = [line for line in lines if " ERROR " in line]
    assert errors, "\n".join(lines[-30:])
    said = [line for line in lines if errors[-1].partition(" ERROR ")[2] in line]
    assert len(said) == 1, "\n".join(lines[-30:])
    return errors[-1]


def drawn_rows(run: RunDir) -> tuple[list[int], list[int], int]:
    """(rows in the batches on disk, rows pending in the last checkpoint, rows drawn by then):
    a row is named by its prompt (fake_inference.row_name)."""
    from fake_inference import row_name
    from tokenizers import Tokenizer

    names = {row_name(i): i for i in range(5000)}
    tokenizer = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
    last = run.checkpoint_steps("orchestrator")[-1]
    step, cursor, pending = decode_state((run.checkpoint_dir(last) / "orchestrator" / "state.json").read_bytes())
    batched = []
    for n in range(1, step + 1):
        batch = Batch.read(run.rollout_dir(n))
        for s in batch.sample_slices()[::2]:  # group_size 2: one prompt per two samples
            prompt = batch.tokens[s][: int(batch.loss_mask[s].argmax())].tolist()
            batched.append(names[tokenizer.decode(prompt).replace(" ", "").rstrip("=")])
    return batched, [names[p.row["prompt"].rstrip("=")] for p in pending if len(p.row["prompt"]) < 50], cursor


# --- at start-up ---------------------------------------------------------------------------------


@pytest.mark.parametrize("program", ["orchestrator", "run"])
def test_the_demo_at_a_seq_len_its_prompts_cannot_fit_is_refused_before_anything_starts(tmp_path, program):
    """configs/demo.toml's chat prompts take 27 tokens; with max_tokens 10, seq_len 30 leaves 20."""
    out = tmp_path / "run"
    result = subprocess.run(rl_command(program, "@", str(ROOT / "configs/demo.toml"), "--seq_len", "30",
                                       "--output_dir", str(out), "--inference.port", str(free_port())),
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0] == (f"rl {program}: dataset spell_backward: 64 of the first 64 prompts leave less than "
                        "max_tokens (10) within seq_len (30); the longest is 27 tokens (reasoning_gym spell_backward "
                        "row 0), over the 20 a prompt may take: raise seq_len, lower orchestrator.max_tokens")
    assert not out.exists()  # nothing written, no program started


def test_a_tool_environment_whose_schemas_and_question_overflow_is_refused(tmp_path):
    """The observed defect: system prompt + tool schemas + question longer than seq_len."""
    out = tmp_path / "run"
    result = subprocess.run(rl_command("orchestrator", "@", str(ROOT / "configs/tools_demo.toml"), "--seq_len", "128",
                                       "--output_dir", str(out)), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("rl orchestrator: orchestrator.environment = 'orchestrator.tasks.calculator:Calculator': "
                               "64 of the first 64 prompts leave less than max_tokens (64) within seq_len (128); "
                               "the longest is "), lines[0]
    assert "tool schemas" in lines[0] and not out.exists()


def test_the_check_measures_the_ids_the_orchestrator_sends(tmp_path):
    """The same rendering code: the check's count equals the length of the prompt ids the
    orchestrator's Renderer and tool episodes make, row by row (a chat dataset with a system
    prompt, and the tool environment)."""
    from orchestrator.rollouts import Rollouts
    from rl.config import load_config
    from rl.prompt_fit import _measure_dataset, _opening, _sample, _tokenizer

    cfg, _ = load_config(["@", str(ROOT / "configs/demo.toml"), "--orchestrator.system_prompt", "Spell it backwards."])
    rollouts = Rollouts(cfg, _tokenizer(cfg.model), {}, None, None)
    ds = cfg.orchestrator.resolved_datasets()[0]
    lengths = [len(rollouts.renderer.render(ds, row, where)[1]) for row, where in _sample(cfg, ds)]
    assert max(lengths) == _measure_dataset(cfg, ds, rollouts.renderer.template, rollouts.fast).tokens > 27

    cfg, _ = load_config(["@", str(ROOT / "configs/tools_demo.toml")])
    from orchestrator.tasks.calculator import Calculator

    env = Calculator()
    rollouts = Rollouts(cfg, _tokenizer(cfg.model), {}, None, env)
    measure = _opening(cfg, env, rollouts.fast)

    async def first_turn(request_id, tokens):
        raise StopAsyncIteration  # the opening prompt, appended before the first turn, is all we need

    for _, row in zip(range(8), env.dataset(cfg.seed)):
        ids: list[int] = []
        with pytest.raises(StopAsyncIteration):
            asyncio.run(rollouts.tool_episode.run(row, "e", first_turn, lambda x, sample=None: ids.extend(x)))
        assert len(ids) == measure(row) > 100


# --- at run time -----------------------------------------------------------------------------------


def test_a_useful_group_ends_the_streaks_it_concerns():
    """The rule itself (orchestrator/streaks.py): rows of one dataset skipped do not count against
    another; a useful group of a dataset ends its streaks and the run's filtered streak; a dataset
    filtered while another fills batches does not stop the run."""
    from orchestrator.streaks import Streaks

    streaks = Streaks(limit=3)
    for _ in range(10):  # two skips, then a useful group: never three in a row
        streaks.hit("skipped", "dataset a", "too long", "raise seq_len")
        streaks.hit("skipped", "dataset a", "too long", "raise seq_len")
        streaks.hit("filtered", "dataset b", "reward 1", "easier")
        streaks.hit("filtered", "dataset b", "reward 1", "easier")
        streaks.good("dataset a")
    assert streaks.verdict is None
    for who in ("dataset a", "dataset b", "dataset a"):  # failures of two datasets: counted apart
        streaks.hit("failed", who, "ValueError", "fix it")
    assert streaks.verdict is None
    streaks.hit("failed", "dataset a", "ValueError: no answer", "fix its reward")
    assert str(streaks.verdict) == ("dataset a: 3 groups in a row failed (orchestrator.max_futile_streak = 3); "
                                    "last: ValueError: no answer; stopping: fix its reward")
    never = Streaks(limit=0)
    for _ in range(1000):
        never.hit("skipped", "dataset a", "too long", "raise seq_len")
    assert never.verdict is None



def test_rows_skipped_many_times_in_a_row_stop_the_run_with_one_line(tmp_path, stand_in):
    """Rows 64 on are too long for seq_len: once the good rows are used up, every row drawn is
    skipped; after max_futile_streak of them the orchestrator stops, naming the dataset, the reason
    and the fix. Skips are said once per batch with a count, never once per row."""
    cfg = orchestrator_config(tmp_path, stand_in.url, async_level=100)  # the good rows make 16 batches
    lines, code = run_orchestrator(cfg, tmp_path)
    text = "\n".join(lines[-30:])
    assert code == 1, text
    error = the_error(lines)
    assert f"dataset data: {STREAK} rows in a row skipped, none made a group (orchestrator.max_futile_streak = " \
           f"{STREAK}); last: dataset data, draw " in error, error
    assert "tokens leave no room to generate within seq_len 64; stopping: raise seq_len, lower max_tokens" in error
    skipped = [line for line in lines if "skipped" in line]
    batches = [line for line in lines if " batch " in line and " reward " in line]
    assert len(skipped) <= len(batches) + 1, text  # one line per batch at most, and the stop
    # Nothing lost: the 64 good rows are each in one batch or pending; every other drawn row was too long.
    run = RunDir(tmp_path / "run")
    batched, pending, cursor = drawn_rows(run)
    assert len(batched) == len(set(batched)) and not set(batched) & set(pending)
    assert set(range(min(cursor, GOOD_ROWS))) == set(batched) | set(pending)
    assert len(batched) == 4 * len(run.rollout_steps())


def test_groups_all_filtered_for_zero_variance_stop_the_run_naming_the_reward_value(tmp_path, stand_in):
    cfg = orchestrator_config(tmp_path, stand_in.url, reward="spin_rows:zero", filter_zero_variance=True)
    lines, code = run_orchestrator(cfg, tmp_path)
    assert code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert (f"dataset data: {STREAK} groups in a row filtered for zero reward variance "
            f"(orchestrator.filter_zero_variance) (orchestrator.max_futile_streak = {STREAK}); last: every rollout of "
            "a group got reward 0; stopping: ") in error, error
    assert "orchestrator.filter_zero_variance = false" in error
    run = RunDir(tmp_path / "run")
    assert not run.rollout_steps() and not run.checkpoint_steps("orchestrator")  # a restart begins at row 0


def test_a_reward_that_always_raises_stops_the_run_naming_it_and_its_error(tmp_path, stand_in):
    """retry_or_drop drops each prompt after 3 failed groups, and would draw new ones forever."""
    cfg = orchestrator_config(tmp_path, stand_in.url, reward="spin_rows:broken")
    lines, code = run_orchestrator(cfg, tmp_path)
    assert code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert f"dataset data: {STREAK} groups in a row failed (orchestrator.max_futile_streak = {STREAK}); " \
           "last: 2 of 2 rollouts failed, last: reward spin_rows:broken raised ValueError: no answer in this row; " \
           "stopping: fix its reward 'spin_rows:broken'" in error, error
    assert not RunDir(tmp_path / "run").rollout_steps()


def test_no_server_in_rotation_for_server_wait_timeout_s_stops_the_run_naming_it(tmp_path, stand_in):
    """The server dies after batch 2 (no trainer: batch 3 waits for version 1). Healing retries
    it; with none in rotation for server_wait_timeout_s the run stops naming it and its error."""
    cfg = orchestrator_config(tmp_path, stand_in.url, server_wait_timeout_s=6)
    handed = threading.Event()

    def on_line(line: str) -> None:
        if "batch 2 reward" in line:
            handed.set()
            stand_in.kill()

    lines, code = run_orchestrator(cfg, tmp_path, on_line=on_line)
    assert handed.is_set() and code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert f"no inference server in rotation for " in error and "(orchestrator.server_wait_timeout_s): " \
           f"{stand_in.url} (" in error and "stopping: restart or fix them" in error, error
    out = [line for line in lines if "out of rotation" in line]
    assert out and lines.index(out[0]) < lines.index(error)
    # Nothing lost: every row drawn by the last checkpoint is in a batch or pending.
    batched, pending, cursor = drawn_rows(RunDir(tmp_path / "run"))
    assert sorted(batched + pending) == list(range(cursor))


def test_rl_run_on_a_real_engine_stops_a_dataset_whose_later_rows_are_too_long(tmp_path):
    """The same path end to end: vLLM serving the tiny model, the real trainer, `rl run`. The
    first 64 rows pass the start-up check and train; once the later ones come, every row drawn
    is skipped, the orchestrator stops with its one line and `rl run` stops the rest, exit 1."""
    (tmp_path / "spin_rows.py").write_text(ROWS)
    out = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{out}"\nseq_len = 64\nmax_steps = 40\n'
                   f'[inference]\nport = {free_port()}\ndtype = "float32"\n'
                   '[orchestrator]\ndataset = "spin_rows:rows"\nreward = "fake_inference:reward"\n'
                   f"prompts_per_step = 4\ngroup_size = 2\nmax_tokens = 6\nmax_in_flight_groups = 8\n"
                   f"max_futile_streak = {STREAK}\n"
                   "[trainer]\ntorch_threads = 1\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), cwd=tmp_path, env=env_with_tests(),
                            capture_output=True, text=True, timeout=480)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text[-3000:]
    assert "orchestrator exited with code 1" in text, text[-3000:]
    run = RunDir(out)
    lines = (run.logs / "orchestrator.log").read_text().splitlines()
    error = the_error(lines)
    assert f"dataset data: {STREAK} rows in a row skipped, none made a group" in error, error
    assert "tokens leave no room to generate within seq_len 64; stopping: raise seq_len" in error, error
    assert not [line for line in lines if "row skipped:" in line]  # no line per row
    if run.checkpoint_steps("orchestrator"):  # nothing lost: good rows batched or pending, the rest too long
        batched, pending, cursor = drawn_rows(run)
        assert len(batched) == len(set(batched)) and not set(batched) & set(pending)
        assert set(range(min(cursor, GOOD_ROWS))) == set(batched) | set(pending)
