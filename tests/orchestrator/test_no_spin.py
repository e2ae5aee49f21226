"""No run that spins (docs/reliability.md): a config whose rows or groups can only come to nothing
ends with one line naming the culprit, why and the fix, instead of drawing rows forever.

- At start-up (orchestrator/rendering/fit.py): prompts that leave no room for max_tokens within seq_len are
  refused by `rl orchestrator` / `rl run`, exit 2, before any engine starts.
- At run time (orchestrator/streaks.py): rows skipped, groups filtered or failed
  orchestrator.scheduling.max_futile_streak times in a row, or no server in rotation for
  timeouts.server_wait_s, stop `rl orchestrator` with one ERROR line and exit 1; the last
  checkpoint accounts for every row drawn (batched, pending, or skipped for being too long).

The run-time stops run the real `rl orchestrator` against the stand-in server of
tests/fake_inference.py (as its own process: `python tests/fake_inference.py PORT`), which a test
can kill; rows skipped at run time are also shown on a real vLLM engine under `rl run`
(test_rl_run_on_a_real_engine_stops_a_dataset_whose_later_rows_are_too_long), and the other three
stops in tests/orchestrator/test_no_spin_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_MODEL, free_port, rl_command
from orchestrator.quiet_warning import QUIET_S
from orchestrator_runs import GOOD_ROWS, ROWS, STREAK, StandIn, drawn_rows, env_with_tests, orchestrator_config, run_orchestrator, the_error
from rl.rundir import RunDir


pytestmark = pytest.mark.slow

@pytest.fixture
def stand_in():
    server = StandIn()
    yield server
    server.kill()


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
    # The rows the run would draw first (shuffled): the first of them at 27 tokens is named.
    assert lines[0] == (f"rl {program}: dataset spell_backward: 64 of the first 64 prompts drawn leave less than "
                        "max_tokens (10) within seq_len (30); the longest is 27 tokens (reasoning_gym spell_backward "
                        "row 9219), over the 20 a prompt may take: raise seq_len, lower orchestrator.sampling.max_tokens")
    assert not out.exists()  # nothing written, no program started


@pytest.mark.parametrize("long_rows, refused", [(4, False), (32, True)])
def test_a_few_long_rows_among_short_ones_start_with_one_warning_half_are_refused(tmp_path, long_rows, refused):
    """The orchestrator serves a prompt that leaves less than max_tokens with what is left
    (rollouts.py `room`): a few such rows are no reason to refuse a run, only to say so once.
    At least half of the rows drawn first: the run would mostly truncate or skip, refused."""
    rows = [{"prompt": f"q{i}" + (" word" * 40 if i < long_rows else "")} for i in range(64)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nseq_len = 64\n[orchestrator]\n'
                   f'sampling.max_tokens = 16\ndatasets = [{{path = "{tmp_path / "rows.jsonl"}", reward = "math_verify"}}]\n')
    result = subprocess.run(rl_command("orchestrator", "@", str(cfg), "--dry-run"), capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    said = [line for line in lines if f"dataset rows: {long_rows} of the first 64 prompts drawn leave less than " \
            "max_tokens (16) within seq_len (64); the longest is " in line]
    assert len(said) == 1 and "raise seq_len, lower orchestrator.sampling.max_tokens" in said[0], result.stderr[-2000:]
    if refused:
        assert result.returncode == 2 and lines == said, result.stderr[-2000:]
    else:
        assert result.returncode == 0 and "those get fewer tokens to generate" in said[0], result.stderr[-2000:]
        assert lines == [said[0], "rl orchestrator: config and start-up checks passed"], result.stderr[-2000:]


def test_a_tool_environment_whose_schemas_and_question_overflow_is_refused(tmp_path):
    """The observed defect: system prompt + tool schemas + question longer than seq_len."""
    out = tmp_path / "run"
    result = subprocess.run(rl_command("orchestrator", "@", str(ROOT / "configs/tools_demo.toml"), "--seq_len", "128",
                                       "--output_dir", str(out)), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("rl orchestrator: orchestrator.environment.class = 'tasks.calculator:Calculator': "
                               "64 of the first 64 prompts drawn leave less than max_tokens (64) within seq_len (128); "
                               "the longest is "), lines[0]
    assert "tool schemas" in lines[0] and not out.exists()


def test_the_check_measures_the_ids_the_orchestrator_sends(tmp_path):
    """The same rendering code: the check's count equals the length of the prompt ids the
    orchestrator's Renderer and tool episodes make, row by row (a chat dataset with a system
    prompt, and the tool environment)."""
    from orchestrator.rendering.fit import measure, sample, tokenizer_of
    from orchestrator.rollout.groups import Rollouts
    from orchestrator.rollout.tool_environment import ToolEpisodes
    from rl.config import load_config

    cfg, _ = load_config(["@", str(ROOT / "configs/demo.toml"), "--orchestrator.prompts.system_prompt", "Spell it backwards."])
    rollouts = Rollouts(cfg, tokenizer_of(cfg.model), {}, None, None)
    ds = cfg.orchestrator.resolved_datasets()[0]
    rows = sample(cfg, ds, "dataset data")
    lengths = [len(rollouts.renderer.render(ds, row, where)[1]) for row, where in rows]
    assert max(lengths) == measure(cfg, ds, rows, rollouts.renderer.template, rollouts.fast).tokens > 27

    cfg, _ = load_config(["@", str(ROOT / "configs/tools_demo.toml")])
    from tasks.calculator import Calculator

    env = Calculator()
    rollouts = Rollouts(cfg, tokenizer_of(cfg.model), {}, None, env)
    measure = ToolEpisodes.start_up(cfg, env)(rollouts.fast)

    async def first_turn(request_id, tokens, images):
        raise StopAsyncIteration  # the opening prompt, appended before the first turn, is all we need

    for _, row in zip(range(8), env.dataset(cfg.seed)):
        ids: list[int] = []
        with pytest.raises(StopAsyncIteration):
            asyncio.run(rollouts.kind.tool_episode.run(row, "e", first_turn, lambda x, sample=None: ids.extend(x)))
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
    assert str(streaks.verdict) == ("dataset a: 3 groups in a row failed (none of its groups was scored between "
                                    "them) (orchestrator.scheduling.max_futile_streak = 3); last: ValueError: no answer; "
                                    "stopping: fix its reward")
    never = Streaks(limit=0)
    for _ in range(1000):
        never.hit("skipped", "dataset a", "too long", "raise seq_len")
    assert never.verdict is None


def test_a_rendered_row_ends_a_skipped_streak_and_a_scored_group_a_failed_one():
    """Start-up fills every slot before any group finishes: with most rows unusable, skips come in
    long runs before the first group is batched. A row that made a request ends its dataset's skipped
    streak; a group scored (even filtered) ends its failed streak; neither ends the other's."""
    from orchestrator.streaks import Streaks

    streaks = Streaks(limit=3)
    for _ in range(100):  # 87% of rows too long, none batched yet: never 3 skips without a rendered row
        streaks.hit("skipped", "dataset a", "too long", "raise seq_len")
        streaks.hit("skipped", "dataset a", "too long", "raise seq_len")
        streaks.rendered("dataset a")
        streaks.hit("failed", "dataset a", "reward down", "fix it")
        streaks.hit("failed", "dataset a", "reward down", "fix it")
        streaks.scored("dataset a")
    assert streaks.verdict is None
    streaks.hit("skipped", "dataset a", "too long", "raise seq_len")
    streaks.scored("dataset a")  # a scored group says nothing of rows that do not render
    streaks.hit("skipped", "dataset a", "too long", "raise seq_len")
    streaks.rendered("dataset b")  # another dataset's row says nothing of this one's
    streaks.hit("skipped", "dataset a", "tokens leave no room", "raise seq_len")
    assert str(streaks.verdict).startswith("dataset a: 3 rows in a row could not be rendered within seq_len")


def test_failed_groups_stop_the_run_only_once_their_streak_lasted_its_span():
    """A reward endpoint restarting fails every group in milliseconds: the count alone would stop
    the run within a second. The failed streak must also have lasted its span (from config:
    MAX_ATTEMPTS x reward_timeout_s); a scored group in between starts it again."""
    from orchestrator.streaks import Streaks

    now = [0.0]
    streaks = Streaks(limit=3, spans={"failed": 180.0}, clock=lambda: now[0])
    for _ in range(1000):  # a thousand failures in 1 s: a restart, not a verdict
        streaks.hit("failed", "dataset a", "connection refused", "fix its reward")
        now[0] += 0.001
    assert streaks.verdict is None
    streaks.scored("dataset a")  # it is back
    now[0] = 1000.0
    streaks.hit("failed", "dataset a", "connection refused", "fix its reward")
    now[0] += 179.0
    for _ in range(5):
        streaks.hit("failed", "dataset a", "connection refused", "fix its reward")
    assert streaks.verdict is None  # 6 failures, but over 179 s
    now[0] += 1.0
    streaks.hit("failed", "dataset a", "connection refused", "fix its reward")
    assert str(streaks.verdict).startswith("dataset a: 7 groups in a row failed (none of its groups was scored "
                                           "between them) over 180 s (orchestrator.scheduling.max_futile_streak = 3)")
    skips = Streaks(limit=3, spans={"failed": 180.0}, clock=lambda: now[0])
    for _ in range(3):  # no span for skips: rows too long do not pass with time
        skips.hit("skipped", "dataset a", "too long", "raise seq_len")
    assert skips.verdict is not None


def test_the_orchestrator_derives_the_failed_span_from_its_timeouts():
    from types import SimpleNamespace

    from orchestrator.group_outcomes import MAX_ATTEMPTS, futile_spans

    o = SimpleNamespace(timeouts=SimpleNamespace(reward_s=60.0, request_s=300.0),
                        teacher=SimpleNamespace(url=None))
    assert futile_spans(o) == {"failed": MAX_ATTEMPTS * 60.0}
    o.teacher.url = "http://teacher:8000"
    assert futile_spans(o) == {"failed": max(MAX_ATTEMPTS * 60.0, 300.0)}


def test_a_repeated_warning_is_said_at_most_every_quiet_s_with_a_count():
    """One helper (orchestrator/quiet_warning.py) for rewards, episodes and eval rows that fail alike."""
    import logging

    from orchestrator.quiet_warning import Quiet

    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("test_quiet")
    logger.addHandler(Catch())
    now = [0.0]
    quiet = Quiet(logger, quiet_s=10.0, clock=lambda: now[0])
    for i in range(200):
        quiet.warn("ValueError: x", f"episode e{i} failed: ValueError: x")
        now[0] += 0.01
    quiet.warn("KeyError: y", "episode f failed: KeyError: y")  # another failure: said at once
    now[0] += 10.0
    quiet.warn("KeyError: y", "episode g failed: KeyError: y")
    assert said == ["episode e0 failed: ValueError: x",  # and 199 like it, counted in the next line
                    "episode f failed: KeyError: y (199 more like the one before not shown)",
                    "episode g failed: KeyError: y"]
    now[0] += 1.0
    for _ in range(5):
        quiet.warn("KeyError: y", "again")
    now[0] += 10.0
    quiet.warn("KeyError: y", "again")
    assert said[-1] == "again (5 more like the one before not shown)"


def test_rows_skipped_many_times_in_a_row_stop_the_run_with_one_line(tmp_path, stand_in):
    """Rows 64 on are too long for seq_len: once the good rows are used up, every row drawn is
    skipped; after max_futile_streak of them the orchestrator stops, naming the dataset, the reason
    and the fix. Skips are said once per batch with a count, never once per row."""
    cfg = orchestrator_config(tmp_path, stand_in.url, async_level=100)  # the good rows make 16 batches
    lines, code = run_orchestrator(cfg, tmp_path)
    text = "\n".join(lines[-30:])
    assert code == 1, text
    error = the_error(lines)
    assert f"dataset data: {STREAK} rows in a row could not be rendered within seq_len (none of its rows made a " \
           f"request between them) (orchestrator.scheduling.max_futile_streak = {STREAK}); last: dataset data, draw " in error, error
    assert "tokens leave no room to generate within seq_len 64; stopping: raise seq_len or shorten the prompts" in error
    skipped = [line for line in lines if "skipped" in line]
    batches = [line for line in lines if " batch " in line and " reward " in line]
    assert len(skipped) <= len(batches) + 1, text  # one line per batch at most, and the stop
    # Nothing lost: the 64 good rows are each in one batch or pending; every other drawn row was too long.
    run = RunDir(tmp_path / "run")
    batched, pending, cursor = drawn_rows(run)
    assert len(batched) == len(set(batched)) and not set(batched) & set(pending)
    assert set(range(min(cursor, GOOD_ROWS))) == set(batched) | set(pending)
    assert len(batched) == 4 * len(run.rollout_steps())


def test_a_dataset_whose_rows_are_mostly_too_long_but_some_fit_goes_on(tmp_path, stand_in):
    """9 rows in 20 are too long. At start-up every free slot is filled at once, so skips come in a
    run longer than max_futile_streak before any group of the usable rows finishes; each usable
    row's request ends the streak, and the run goes on with the usable rows to max_steps."""
    cfg = orchestrator_config(tmp_path, stand_in.url, async_level=100, rows="spin_rows:mixed",
                              scheduling={"max_in_flight_groups": 32})
    lines, _ = run_orchestrator(cfg, tmp_path, stop_when=lambda line: "batch 40 reward" in line)
    assert not [line for line in lines if " ERROR " in line], "\n".join(lines[-30:])
    assert any("row(s) skipped since the previous batch" in line for line in lines), "\n".join(lines[-30:])
    batched, _, _ = drawn_rows(RunDir(tmp_path / "run"))
    assert len(batched) == 4 * 40 and len(set(batched)) == len(batched)
    assert all(i % 20 >= 9 for i in batched)  # only the usable rows


def test_groups_all_filtered_for_zero_variance_stop_the_run_naming_the_reward_value(tmp_path, stand_in):
    cfg = orchestrator_config(tmp_path, stand_in.url, reward="spin_rows:zero",
                              scheduling={"filter_zero_variance": True})
    lines, code = run_orchestrator(cfg, tmp_path)
    assert code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert (f"dataset data: {STREAK} groups in a row filtered for zero reward variance "
            f"(orchestrator.scheduling.filter_zero_variance) (orchestrator.scheduling.max_futile_streak = {STREAK}); last: every group got "
            "the same low reward 0 (the highest seen: 0): unlearnable at temperature 1; stopping: ") in error, error
    assert "orchestrator.scheduling.filter_zero_variance = false (or orchestrator.scheduling.max_futile_streak = 0)" in error
    run = RunDir(tmp_path / "run")
    assert not run.rollout_steps() and not run.checkpoint_steps("orchestrator")  # a restart begins at row 0


def test_a_reward_that_always_raises_stops_the_run_naming_it_and_its_error(tmp_path, stand_in):
    """retry_or_drop drops each prompt after 3 failed groups, and would draw new ones forever. The
    streak must also last 3 x reward_timeout_s (a restarting reward would pass): 1.5 s here."""
    cfg = orchestrator_config(tmp_path, stand_in.url, rows="spin_rows:short", reward="spin_rows:broken",
                              timeouts={"reward_s": 0.5})
    start = time.monotonic()
    lines, code = run_orchestrator(cfg, tmp_path)
    took = time.monotonic() - start
    assert code == 1, "\n".join(lines[-30:])
    assert took >= 1.5  # a lower bound: holds however loaded the machine
    # Each failed group requeues its prompt (STREAK of them at least): said once per QUIET_S.
    requeued = [line for line in lines if "requeued" in line]
    assert 1 <= len(requeued) <= 1 + took / QUIET_S, requeued
    error = the_error(lines)
    assert "dataset data: " in error and " groups in a row failed (none of its groups was scored between them) " \
           "over " in error and f" s (orchestrator.scheduling.max_futile_streak = {STREAK}); " \
           "last: 2 of 2 rollouts failed, last: reward spin_rows:broken raised ValueError: no answer in this row; " \
           "stopping: fix its reward 'spin_rows:broken'" in error, error
    assert not RunDir(tmp_path / "run").rollout_steps()


def test_no_server_in_rotation_for_the_wait_timeout_stops_the_run_naming_it(tmp_path, stand_in):
    """The server dies after batch 2 (no trainer: batch 3 waits for version 1). Healing retries
    it; with none in rotation for timeouts.server_wait_s the run stops naming it and its error."""
    cfg = orchestrator_config(tmp_path, stand_in.url, timeouts={"server_wait_s": 6})
    handed = threading.Event()

    def on_line(line: str) -> None:
        if "batch 2 reward" in line:
            handed.set()
            stand_in.kill()

    lines, code = run_orchestrator(cfg, tmp_path, on_line=on_line)
    assert handed.is_set() and code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert "no inference server in rotation for " in error and "(orchestrator.timeouts.server_wait_s): " \
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
                   '[orchestrator]\ndatasets = [{name = "data", function = "spin_rows:rows", reward = "fake_inference:reward"}]\n'
                   f"scheduling.prompts_per_step = 4\nscheduling.group_size = 2\nsampling.max_tokens = 6\n"
                   f"scheduling.max_in_flight_groups = 8\nscheduling.max_futile_streak = {STREAK}\n"
                   "[trainer]\ntorch_threads = 1\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), cwd=tmp_path, env=env_with_tests(),
                            capture_output=True, text=True, timeout=480)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text[-3000:]
    assert "orchestrator exited with code 1" in text, text[-3000:]
    run = RunDir(out)
    lines = (run.logs / "orchestrator.log").read_text().splitlines()
    error = the_error(lines)
    assert f"dataset data: {STREAK} rows in a row could not be rendered within seq_len" in error, error
    assert "tokens leave no room to generate within seq_len 64; stopping: raise seq_len" in error, error
    assert not [line for line in lines if "row skipped:" in line]  # no line per row
    # Nothing lost: good rows batched or pending, the rest too long. The good rows are drawn only as
    # batches free their slots (8 in flight), so by the first long row at least 14 were checkpointed.
    assert run.checkpoint_steps("orchestrator"), lines[-30:]
    batched, pending, cursor = drawn_rows(run)
    assert len(batched) == len(set(batched)) and not set(batched) & set(pending)
    assert set(range(min(cursor, GOOD_ROWS))) == set(batched) | set(pending)


# --- what the start-up check measures ------------------------------------------------------------


def test_a_text_environment_row_whose_episode_raises_is_that_row_alone(tmp_path):
    """At run time such a row is one failed rollout, not a reason to refuse the run: it is left
    out of the measure; every episode measured is closed."""
    from orchestrator.rendering.fit import environment_fits
    from orchestrator.rollout.text_environment import TextEpisodes
    from rl.config import load_config

    closed = []

    class Episode:
        def __init__(self, row):
            self.row = row

        def start(self):
            if self.row["i"] == 3:
                raise ValueError("this row's episode cannot start")
            return "guess"

        def close(self):
            closed.append(self.row["i"])

    class Env:
        def dataset(self, seed):
            return ({"i": i} for i in range(10))

        def episode(self, row):
            return Episode(row)

    cfg, _ = load_config(["@", str(ROOT / "configs/guess_letter.toml"), "--output_dir", str(tmp_path / "run")])
    env = Env()
    environment_fits(cfg, env, TextEpisodes.start_up(cfg, env), TextEpisodes.fit_keys)  # no ConfigError
    assert closed == list(range(10))


def eval_config(tmp_path: Path, environment: bool, train_long: bool, eval_long: bool) -> Path:
    for name, long in (("train", train_long), ("held", eval_long)):
        rows = [{"prompt": f"q{i}" + (" word" * 40 if long else "")} for i in range(8)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = ('environment.class = "tasks.guess_letter:GuessLetter"\n' if environment else
              f'datasets = [{{path = "{tmp_path / "train.jsonl"}", reward = "math_verify"}}]\n')
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nseq_len = 64\n[orchestrator]\n'
                   f'sampling.max_tokens = 16\n{source}[orchestrator.eval]\n'
                   f'datasets = [{{path = "{tmp_path / "held.jsonl"}", reward = "math_verify"}}]\n')
    return cfg


@pytest.mark.parametrize("environment", [False, True])
def test_eval_datasets_are_measured_beside_an_environment_and_rl_eval_measures_only_them(tmp_path, environment):
    from orchestrator.preflight import eval_data, orchestrator_data
    from rl.config import ConfigError, load_config

    cfg, _ = load_config(["@", str(eval_config(tmp_path, environment, train_long=False, eval_long=True))])
    for check in (orchestrator_data, eval_data):
        with pytest.raises(ConfigError, match="^eval dataset held: 8 of the first 8 prompts drawn leave less"):
            check(cfg)
    cfg, _ = load_config(["@", str(eval_config(tmp_path, environment, train_long=True, eval_long=False))])
    eval_data(cfg)  # rl eval trains on nothing: the training rows are not its concern
    if not environment:
        with pytest.raises(ConfigError, match="^dataset train: 8 of the first 8 prompts drawn leave less"):
            orchestrator_data(cfg)
