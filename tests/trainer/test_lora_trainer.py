"""The LoRA trainer as a real program (FSDP2, gloo): adapters in peft format, ranks, resume, and
several runs on one trainer that never touch each other's adapter."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import TINY_MODEL, rl_command
from rl.rundir import RunDir
from trainer_runs import (BAD, ENV, GOOD, assert_same_step, completion_logprob, run_trainer, torchrun,
                          trainer_metrics, write_batches)

pytestmark = pytest.mark.slow

LORA = "[trainer.lora]\nrank = 4\nalpha = 8\n"


def lora_config(write_toml, root, name: str, *, max_steps: int = 2, lr: float = 2e-3, extra: str = "") -> str:
    text = (f'model = "{TINY_MODEL}"\noutput_dir = "{root}"\nmax_steps = {max_steps}\nseq_len = 32\n{extra}'
            "[checkpoints]\nevery = 1\n[trainer]\nbatching.micro_batch_tokens = 40\ntorch_threads = 1\n"
            f"[trainer.optim]\nlr = {lr}\n" + LORA)
    return str(write_toml(text, name))


def adapter(run: RunDir, step: int) -> dict[str, torch.Tensor]:
    return load_file(run.weights_dir(step) / "adapter_model.safetensors")


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k] - b[k]).abs().max()))


# Two runs that several tests share (a trainer start, on two ranks above all, is what these tests
# spend their time on): run a of the multi-run test trained alone on two ranks, and the same run on
# one rank, 3 steps each at lr 2e-3 on write_batches' batches (4 prompts). Two ranks with
# activation checkpointing: neither may change the maths (the adapter test's one-rank comparison),
# and the multi-run trainer runs with it too, so that its run a sums exactly as this one does.
# The runs compared with them (the resumed one-rank run, run b alone and in the multi-run
# trainer) take the same setting.
CHECKPOINTING = ["--trainer.model.activation_checkpointing", "true"]


def shared_run(tmp_path_factory, name: str, cmd: list[str]) -> RunDir:
    tmp = tmp_path_factory.mktemp(name)
    run = RunDir(tmp / name)
    write_batches(run, [1, 2, 3], prompts=4)

    def write(text: str, file: str):
        (tmp / file).write_text(text)
        return tmp / file

    cfg = lora_config(write, run.root, f"{name}.toml", max_steps=3, lr=2e-3)
    # Every checkpoint kept (3): the one-rank comparison starts from step 1's.
    run_trainer(cmd, ["@", cfg, *CHECKPOINTING, "--checkpoints.keep", "3"])
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> RunDir:
    return shared_run(tmp_path_factory, "two_ranks", torchrun(2))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> RunDir:
    return shared_run(tmp_path_factory, "one_rank", rl_command("trainer"))


def test_adapter_only_training_matches_across_ranks_and_loads_in_peft(tmp_path, write_toml, two_ranks, one_rank):
    """Step 1 on one rank and on two from the same start; then step 2 on one rank from the
    two-rank run's step-1 checkpoint (DCP reshards it), each step compared where both took it
    from the same state (assert_same_step: two independent runs would compare step 2 from
    weights that Adam's first step already set apart by rounding)."""
    two, one = two_ranks, RunDir(tmp_path / "one")
    assert_same_step(two, one_rank, 1)
    write_batches(one, [1, 2])
    shutil.copytree(two.checkpoint_dir(1) / "trainer", one.checkpoint_dir(1) / "trainer")
    log = run_trainer(rl_command("trainer"), ["@", lora_config(write_toml, one.root, "one.toml"), *CHECKPOINTING,
                                              "--resume"])
    assert "resumed from checkpoints/step_1: next batch is 2" in log, log[-3000:]
    assert_same_step(two, one, 2)

    # Only the adapter is published: a few KB instead of the model.
    files = sorted(p.name for p in one.weights_dir(2).iterdir())
    assert files == ["STABLE", "adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((one.weights_dir(2) / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

    # peft reads it, and the adapted policy moved towards the positive-advantage completion.
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    before = completion_logprob(base, GOOD) - completion_logprob(base, BAD)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32),
                                      str(one.weights_dir(2)))
    after = completion_logprob(tuned, GOOD) - completion_logprob(tuned, BAD)
    assert after > before + 0.05, (before, after)
    # lora_B starts at zero and was trained; the base weights were never written.
    assert all(t.abs().max() > 0 for k, t in adapter(one, 2).items() if "lora_B" in k)


def test_resumed_lora_run_matches_an_uninterrupted_one(tmp_path, write_toml, one_rank):
    whole, parts = one_rank, RunDir(tmp_path / "parts")
    write_batches(parts, [1, 2, 3])
    cfg = lora_config(write_toml, parts.root, "parts.toml", max_steps=3)
    run_trainer(rl_command("trainer"), ["@", cfg, *CHECKPOINTING, "--max_steps", "2"])
    err = run_trainer(rl_command("trainer"), ["@", cfg, *CHECKPOINTING, "--resume"])
    assert "next batch is 3" in err
    # Adapter and AdamW moments came back: step 3 is bit-for-bit the uninterrupted one.
    whole3, parts3 = adapter(whole, 3), adapter(parts, 3)
    assert all(torch.equal(whole3[k], parts3[k]) for k in whole3)


def write_run(write_toml, root, name: str, lr: float, max_steps: int) -> RunDir:
    """A multi-run run directory as its orchestrator leaves it: resolved config and heartbeat."""
    run = RunDir(root / "runs" / name)
    run.make()
    text = open(lora_config(write_toml, root, f"{name}.toml", max_steps=max_steps, lr=lr,
                            extra=f'run_name = "{name}"\n')).read()
    run.config_file("orchestrator").write_text(text)
    run.heartbeat.write_text(f"test-{name} 0\n")
    return run


def test_runs_on_one_trainer_train_only_their_own_adapters_and_join_leave_or_fail_alone(tmp_path, write_toml,
                                                                                          two_ranks):
    # The reference: each run trained alone by a single-run LoRA trainer (on two ranks too, so
    # the gradient reductions round alike; with activation checkpointing, as two_ranks, run a's).
    alone_a, alone_b = two_ranks, RunDir(tmp_path / "alone_b")
    write_batches(alone_b, [1, 2], prompts=2)
    ab = lora_config(write_toml, alone_b.root, "ab.toml", max_steps=2, lr=5e-3)
    run_trainer(torchrun(2), ["@", ab, *CHECKPOINTING])

    root = tmp_path / "shared"
    a = write_run(write_toml, root, "a", lr=2e-3, max_steps=3)
    b = write_run(write_toml, root, "b", lr=5e-3, max_steps=3)
    b.heartbeat.unlink()  # b's orchestrator is not there yet
    c = write_run(write_toml, root, "c", lr=2e-3, max_steps=3)  # a run whose first batch is corrupt
    write_batches(a, [1, 2], prompts=4)
    write_batches(b, [1], prompts=2)
    write_batches(c, [1], prompts=2)
    payload = c.rollout_dir(1) / "batch.safetensors"
    payload.write_bytes(payload.read_bytes()[:-100])
    trainer_cfg = lora_config(write_toml, root, "trainer.toml", extra="")
    proc = subprocess.Popen(
        torchrun(2) + ["@", trainer_cfg, "--trainer.lora.multi_run", "true", "--trainer.lora.slots", "2",
                       "--trainer.lora.idle_exit_s", "3", *CHECKPOINTING],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)

    def wait_for(path):
        deadline = time.monotonic() + 240
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)

    try:
        wait_for(a.weights_dir(2) / "STABLE")  # a trained what it has and waits for batch 3
        b.heartbeat.write_text("test-b 0\n")  # b's orchestrator starts: b joins while a is in
        wait_for(b.weights_dir(1) / "STABLE")
        b.heartbeat.unlink()  # b's orchestrator stops after one batch: b leaves, checkpointed
        while json.loads(b.trainer_status.read_text())["status"] != "left":
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        write_batches(b, [2], prompts=2)
        b.heartbeat.write_text("test-b 1\n")  # a restarted orchestrator: b rejoins where it left
        wait_for(b.weights_dir(2) / "STABLE")
        b.heartbeat.unlink()
        write_batches(a, [3], prompts=4)
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]

    # Run a went to the end with exactly the adapter it gets alone; b trained with its own
    # learning rate, left, came back and continued exactly. Same ranks, same micro-batches: the
    # same sums in the same order, so bit for bit on any CPU (a tolerance would buy nothing:
    # where a gradient is of the order of Adam's eps, the update amplifies a difference in it
    # lr/eps = 2e5 times).
    assert_equal(adapter(a, 3), adapter(alone_a, 3))
    for n in (1, 2):  # step 2 came after leaving and rejoining: adapter and Adam state restored
        assert_equal(adapter(b, n), adapter(alone_b, n))
    assert [m["step"] for m in trainer_metrics(a)] == [1, 2, 3]
    assert [m["step"] for m in trainer_metrics(b)] == [1, 2]
    assert all(m["run"] == "b" for m in trainer_metrics(b))
    assert json.loads(a.trainer_status.read_text())["status"] == "finished"
    status = json.loads(b.trainer_status.read_text())
    assert status["status"] == "left" and "orchestrator stopped" in status["detail"]
    assert b.checkpoint_steps("trainer") == [1, 2]
    assert "run b left after step 1" in err and "run b joined in slot" in err and "at step 2 of 3" in err
    assert "run b left after step 2" in err and "run a finished after step 3" in err
    # c failed on its corrupt batch, alone; its slot went to b.
    status = json.loads(c.trainer_status.read_text())
    assert status["status"] == "failed" and "checksum" in status["detail"], status
    assert not c.weight_steps()
