"""LoRA through the real programs: one vLLM server with LoRA, the trainer, orchestrators. Only
adapters move; several runs share one trainer and one server and never touch each other."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL, rl_command
from rl.batch import Batch
from rl.rundir import RunDir
from programs import Program, start_server, train
from trainer_runs import run_trainer

pytestmark = pytest.mark.slow

LORA = "[trainer.lora]\nrank = 8\nalpha = 16\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_e2e")
    root = tmp / "root"
    proc, url = start_server(tmp, "server", TINY_MODEL, root, extra="max_loras = 6\n" + LORA)
    try:
        yield {"url": url, "port": url.rsplit(":", 1)[1], "root": root, "tmp": tmp}
    finally:
        proc.stop()


def base_config(server, extra: str = "") -> str:
    # max_async_level 1: the version bounds asserted below are its.
    return (f'model = "{TINY_MODEL}"\noutput_dir = "{server["root"]}"\nseq_len = 64\nmax_async_level = 1\n{extra}'
            f'[inference]\nport = {server["port"]}\ndtype = "float32"\nmax_loras = 6\n'
            "[checkpoints]\nevery = 2\n[trainer]\ntorch_threads = 1\nfiles.keep_rollouts = 50\n" + LORA)


def run_config(task: str, lr: float, max_steps: int) -> str:
    return (f'[orchestrator]\ndatasets = [{{function = "tasks.{task}:dataset", reward = "tasks.{task}:reward"}}]\n'
            "scheduling.prompts_per_step = 4\nscheduling.group_size = 4\nscheduling.max_in_flight_groups = 8\n"
            "sampling.max_tokens = 10\n"
            f"[trainer.optim]\nlr = {lr}\n")


def health(server) -> dict:
    return httpx.get(f"{server['url']}/health", timeout=10).json()


# Two eval datasets, evaluated one after the other: between them no request holds the adapter,
# which must stay loaded while training moves on.
EVAL = ("[orchestrator.eval]\nrows = 24\nevery = 1\nconcurrency = 4\n" + "".join(
    f'[[orchestrator.eval.datasets]]\nname = "{task}"\nfunction = "tasks.{task}:dataset"\n'
    f'reward = "tasks.{task}:reward"\n' for task in ("reverse", "echo")))


def test_a_lora_run_moves_only_adapters(server):
    tmp = server["tmp"]
    run = RunDir(server["root"])
    cfg = tmp / "single.toml"
    cfg.write_text(base_config(server, "max_steps = 3\n") + run_config("reverse", 2e-3, 3) + EVAL)
    trainer = train(cfg, tmp)

    for n in (1, 2, 3):
        assert sorted(p.name for p in run.weights_dir(n).iterdir()) == [
            "STABLE", "adapter_config.json", "adapter_model.safetensors"]
        batch = Batch.read(run.rollout_dir(n))
        assert batch.versions.min() >= n - 2 and batch.versions.max() <= n - 1
    orchestrator_log = (tmp / "orchestrator.log").read_text()
    assert "adapter policy-v3" in orchestrator_log
    # Evaluated with each step's adapter, on both datasets, none failing.
    evals = [json.loads(line) for line in run.metrics.read_text().splitlines() if '"program": "eval"' in line]
    assert sorted(r["step"] for r in evals) == [0, 1, 2, 3]
    assert all(r["eval/reverse/rows"] == r["eval/echo/rows"] == 24 and r["version"] >= r["step"] for r in evals)
    assert "evaluation at step" not in orchestrator_log
    # The base weights never moved, and the finished run gave its adapter slots back.
    h = health(server)
    assert h["version"] == 0 and h["adapters"] == {}
    assert "done: 3 steps" in trainer.log.read_text()


def test_two_runs_share_one_trainer_and_server_and_one_stopping_leaves_the_other_training(server):
    tmp = server["tmp"]
    root = server["root"]
    base = tmp / "base.toml"
    base.write_text(base_config(server, "max_steps = 6\n") +
                    "multi_run = true\nslots = 2\nidle_exit_s = 4\n")
    (tmp / "a.toml").write_text('run_name = "a"\n' + run_config("reverse", 2e-3, 6))
    (tmp / "b.toml").write_text('run_name = "b"\n' + run_config("echo", 1e-3, 6))
    a, b = RunDir(root / "runs" / "a"), RunDir(root / "runs" / "b")

    trainer = Program("trainer", base, tmp, log_name="multi_trainer")
    orch_a = Program("orchestrator", base, tmp, extra=("@", str(tmp / "a.toml")), log_name="orch_a")
    orch_b = Program("orchestrator", base, tmp, extra=("@", str(tmp / "b.toml")), log_name="orch_b")
    try:
        deadline = time.monotonic() + 300
        while not (b.weights_dir(2) / "STABLE").exists():
            for p in (trainer, orch_a, orch_b):
                assert p.proc.poll() is None, p.tail()
            assert time.monotonic() < deadline, trainer.tail()
            time.sleep(0.2)
        orch_b.stop()  # SIGTERM: run b stops part-way
        assert orch_b.proc.returncode == 143, orch_b.tail()
        assert orch_a.wait(300) == 0, orch_a.tail()
        assert trainer.wait(120) == 0, trainer.tail()  # idle_exit_s after the last run left
    finally:
        for p in (trainer, orch_a, orch_b):
            p.stop()

    # Run a trained to its end; b left where it stopped, checkpointed, its adapter unchanged since.
    assert json.loads(a.trainer_status.read_text())["status"] == "finished"
    status = json.loads(b.trainer_status.read_text())
    assert status["status"] == "left", status
    left_at = status["step"]
    assert left_at >= 2 and b.weight_steps()[-1] == left_at
    assert b.checkpoint_steps("trainer")[-1] == left_at
    assert not b.heartbeat.exists()
    log = trainer.log.read_text()
    assert "run b left after step" in log and "run a finished after step 6" in log
    assert (a.weights_dir(6) / "adapter_model.safetensors").exists()
    # Each run's own metrics, and its own reward: the two tasks score different things.
    for run, name in ((a, "a"), (b, "b")):
        records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
        assert {r["run"] for r in records if r["program"] == "trainer"} == {name}
    # Both orchestrators gave their adapter slots back; the base model never moved.
    h = health(server)
    assert h["version"] == 0 and h["adapters"] == {}

    # Run a's adapter came from run a's batches alone: replaying them on a trainer of its own
    # gives the same adapter.
    replay = RunDir(tmp / "replay")
    for n in range(1, 7):
        shutil.copytree(a.rollout_dir(n), replay.rollout_dir(n))
    cfg = tmp / "replay.toml"
    cfg.write_text(base_config(server, "max_steps = 6\n").replace(str(root), str(replay.root)) +
                   run_config("reverse", 2e-3, 6))
    run_trainer(rl_command("trainer"), ["@", str(cfg)])
    got = load_file(a.weights_dir(6) / "adapter_model.safetensors")
    want = load_file(replay.weights_dir(6) / "adapter_model.safetensors")
    # One rank each, the same batches and micro-batches: the same sums in the same order, so bit
    # for bit on any CPU (run b sharing the trainer changes none of run a's arithmetic).
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), (k, float((got[k] - want[k]).abs().max()))
