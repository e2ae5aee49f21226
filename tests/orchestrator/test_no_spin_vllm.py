"""The run-time no-spin stops of tests/orchestrator/test_no_spin.py (groups all filtered, a reward that always
raises, no server in rotation) on a real engine: one `rl inference` (vLLM serving the tiny
model) shared by the cases, the real `rl orchestrator` against it alone (no trainer: batches 1
and 2 go out, then it waits for version 1). A short max_futile_streak stops them within a few
groups. The last case kills the server: it runs last."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from conftest import TINY_MODEL
from orchestrator_runs import ROWS, drawn_rows, run_orchestrator, the_error
from programs import launch_server, wait_healthy
from rl.rundir import RunDir


pytestmark = pytest.mark.slow

STREAK = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no_spin_vllm")
    proc, url = launch_server(tmp, "server", TINY_MODEL, tmp / "run")
    try:
        wait_healthy(proc, url)
        yield proc, url
    finally:
        proc.stop()


def config(tmp: Path, url: str, dataset: dict, **tables: dict) -> Path:
    """The orchestrator's config against `url`: `dataset` its one [[orchestrator.datasets]] entry,
    `tables` its sub-tables' (scheduling, sampling, timeouts, servers) beyond these defaults."""
    (tmp / "spin_rows.py").write_text(ROWS)
    sub = {"servers": {"urls": [url], "discover": False},
           "scheduling": {"prompts_per_step": 4, "group_size": 2, "max_in_flight_groups": 8,
                          "max_futile_streak": STREAK},
           "sampling": {"max_tokens": 6}, "timeouts": {"weights_s": 300}}
    for name, keys in tables.items():
        sub[name] = {**sub[name], **keys}
    text = (f'model = "{TINY_MODEL}"\noutput_dir = "{tmp / "run"}"\nseq_len = 64\nmax_steps = 40\n'
            "max_async_level = 1\n[[orchestrator.datasets]]\nname = \"data\"\n"
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in dataset.items()))
    for name, keys in sub.items():
        text += f"[orchestrator.{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    (tmp / "cfg.toml").write_text(text)
    return tmp / "cfg.toml"


def test_groups_all_filtered_stop_the_run_naming_the_reward_value(tmp_path, server):
    _, url = server
    cfg = config(tmp_path, url, {"function": "spin_rows:short", "reward": "spin_rows:zero"},
                 scheduling={"filter_zero_variance": True})
    lines, code = run_orchestrator(cfg, tmp_path)
    assert code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert (f"dataset data: {STREAK} groups in a row filtered for zero reward variance "
            f"(orchestrator.scheduling.filter_zero_variance) (orchestrator.scheduling.max_futile_streak = {STREAK}); "
            "last: every group got the same low reward 0 (the highest seen: 0): unlearnable at temperature 1; "
            "stopping: ") in error, error
    run = RunDir(tmp_path / "run")
    assert not run.rollout_steps() and not run.checkpoint_steps("orchestrator")


def test_a_reward_that_always_raises_stops_the_run_naming_it_and_its_error(tmp_path, server):
    _, url = server
    cfg = config(tmp_path, url, {"function": "spin_rows:short", "reward": "spin_rows:broken"},
                 timeouts={"reward_s": 0.5})
    lines, code = run_orchestrator(cfg, tmp_path)
    assert code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert "dataset data: " in error and " groups in a row failed (none of its groups was scored between them) " \
           "over " in error and f" s (orchestrator.scheduling.max_futile_streak = {STREAK}); " \
           "last: 2 of 2 rollouts failed, last: reward spin_rows:broken raised ValueError: no answer in this row; " \
           "stopping: fix its reward 'spin_rows:broken'" in error, error
    assert not RunDir(tmp_path / "run").rollout_steps()


def test_no_server_in_rotation_for_the_wait_timeout_stops_the_run_naming_it(tmp_path, server):
    """The real server SIGKILLed (its whole group, engine core included) once batch 2 is out: with
    none in rotation for timeouts.server_wait_s the run stops naming it; nothing drawn is lost."""
    proc, url = server
    cfg = config(tmp_path, url, {"function": "spin_rows:short", "reward": "fake_inference:reward"},
                 timeouts={"server_wait_s": 6})
    handed = threading.Event()

    def on_line(line: str) -> None:
        if "batch 2 reward" in line and not handed.is_set():
            handed.set()
            os.killpg(proc.proc.pid, signal.SIGKILL)

    lines, code = run_orchestrator(cfg, tmp_path, on_line=on_line)
    assert handed.is_set() and code == 1, "\n".join(lines[-30:])
    error = the_error(lines)
    assert "no inference server in rotation for " in error and "(orchestrator.timeouts.server_wait_s): " \
           f"{url} (" in error and "stopping: restart or fix them" in error, error
    out = [line for line in lines if "out of rotation" in line]
    assert out and lines.index(out[0]) < lines.index(error)
    batched, pending, cursor = drawn_rows(RunDir(tmp_path / "run"))
    assert sorted(batched + pending) == list(range(cursor))
