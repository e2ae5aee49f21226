"""Kill the orchestrator or the trainer at any moment, restart it, lose nothing (the run and its
checks: real_run.py). One vLLM server serves every case here.

Exact points (the middle of a batch or weights write, between handing a batch over and
checkpointing it, between two steps) come from crash points (src/rl/faults.py): the program
SIGKILLs itself there. "Mid-generation" needs no help: from the first batch on the orchestrator
always has groups generating.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file

from conftest import free_port
from real_run import MAX_STEPS, REPORTED_WITHIN_S, RealRun, in_log

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    """One vLLM server for the cases that do not kill it. Each case gets a fresh run directory
    under the server's output_dir (emptied between cases): every run starts from version 0,
    which the orchestrator loads back from the base model."""
    tmp = tmp_path_factory.mktemp("faults")
    port = free_port()
    server_run = RealRun(tmp, port)
    server_run.start_server()
    yield tmp, port
    server_run.stop_all()


@pytest.fixture
def real_run(server_port, request):
    tmp, port = server_port
    run = RealRun(tmp, port, extra=getattr(request, "param", ""))
    for child in run.run.root.iterdir():
        if child.name != "heartbeats":  # the server's own heartbeat lives there
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    for log in tmp.glob("*.log"):
        if log.name != "inference.log":
            log.unlink()
    yield run
    run.stop_all()


# --- the orchestrator ------------------------------------------------------------------------


def test_orchestrator_killed_mid_generation_is_reported_then_resumes(real_run):
    r = real_run
    trainer, orchestrator = r.start("trainer"), r.start("orchestrator")
    r.wait_for("step 2", lambda: r.trained() >= 2, watch=(trainer, orchestrator))
    assert orchestrator.proc.poll() is None
    os.kill(orchestrator.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    # The trainer, waiting for the next batch, names the silent orchestrator.
    r.wait_for("the trainer to report the orchestrator", lambda: in_log(trainer, "orchestrator silent for"),
               timeout=45, watch=(trainer,))
    reported = time.monotonic() - killed
    print(f"reported after {reported:.1f} s")
    assert reported < REPORTED_WITHIN_S
    orchestrator = r.start("orchestrator")
    r.finish(trainer, orchestrator)
    assert in_log(orchestrator, "resuming after batch")
    r.check_complete()


@pytest.mark.parametrize("point", ["orchestrator.checkpointed", "batch.staged", "orchestrator.handed_over"])
def test_orchestrator_killed_while_handing_a_batch_over_resumes_without_a_gap(real_run, point):
    """Killed with batch 3 checkpointed but not written, or written but not renamed into place
    (it never existed: the restarted orchestrator hands the checkpointed bytes over), or handed
    over (it continues after it). Either way no prompt is used twice or lost (check_complete)."""
    r = real_run
    trainer, orchestrator = r.start("trainer"), r.start("orchestrator", crash_at=f"{point}:3")
    assert orchestrator.wait(240) == -signal.SIGKILL, orchestrator.tail()
    assert 3 in r.run.checkpoint_steps("orchestrator")
    if point == "batch.staged":
        assert list(r.run.rollouts.glob(".step_3.*")), "the crash point was not inside the batch write"
    assert (3 in r.run.rollout_steps()) == (point == "orchestrator.handed_over")
    assert [rec["step"] for rec in r.records("orchestrator")] == [1, 2], "batch 3's record before its kill"
    orchestrator = r.start("orchestrator")
    r.finish(trainer, orchestrator)
    r.check_complete()  # batch 3's record included, once
    assert [rec.get("recovered") for rec in r.records("orchestrator")] == [None, None, True, None, None, None]


# --- the trainer -----------------------------------------------------------------------------


def test_trainer_killed_mid_weights_write_is_reported_then_resumes(real_run):
    r = real_run
    trainer, orchestrator = r.start("trainer", crash_at="weights.staged:3"), r.start("orchestrator")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    killed = time.monotonic()
    assert (r.run.weights / ".step_3.tmp").is_dir() and 3 not in r.run.weight_steps()
    r.wait_for("the orchestrator to report the trainer", lambda: in_log(orchestrator, "trainer silent for"),
               timeout=45, watch=(orchestrator,))
    reported = time.monotonic() - killed
    print(f"reported after {reported:.1f} s")
    assert reported < REPORTED_WITHIN_S
    trainer = r.start("trainer", "--resume")
    r.finish(trainer, orchestrator)
    assert in_log(trainer, "resumed from checkpoints/step_2")
    r.check_complete()


@pytest.mark.parametrize("real_run", ["", f'[transport]\nkind = "zmq"\naddress = "tcp://127.0.0.1:{free_port()}"\n'],
                         ids=["filesystem", "zmq"], indirect=True)
def test_trainer_killed_between_steps_resumes_at_the_next_batch(real_run):
    """Over ZMQ the batches queued for the dead trainer died with it: the orchestrator sees a new
    trainer instance (its heartbeat) and sends every untrained batch again."""
    r = real_run
    trainer, orchestrator = r.start("trainer", crash_at="trainer.after_step:3"), r.start("orchestrator")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    trainer = r.start("trainer", "--resume")
    r.finish(trainer, orchestrator)
    assert in_log(trainer, "resumed from checkpoints/step_3: next batch is 4")
    r.check_complete()


def test_trainer_killed_between_its_checkpoint_and_its_record_records_the_step_once(real_run):
    """Killed with step 3 checkpointed but its metrics record not written: the resumed trainer
    writes the record the checkpoint kept (marked recovered), so every step has exactly one."""
    r = real_run
    trainer, orchestrator = r.start("trainer", crash_at="trainer.checkpointed:3"), r.start("orchestrator")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    assert [rec["step"] for rec in r.records("trainer")] == [1, 2]
    trainer = r.start("trainer", "--resume")
    r.finish(trainer, orchestrator)
    assert in_log(trainer, "resumed from checkpoints/step_3: next batch is 4")
    r.check_complete()  # trainer records 1..6, once each, in order
    step3 = r.records("trainer")[2]
    assert step3["recovered"] is True and step3["loss_tokens"] > 0 and "loss" in step3, step3


def test_trainer_killed_before_its_first_checkpoint_replays_from_the_base_model(real_run):
    """No checkpoint yet (checkpoint_every 50): --resume starts again at step 1 from the base
    model on the kept batches, and republishes exactly the versions the killed trainer did."""
    r = real_run
    sparse = ("--trainer.checkpoint_every", "50")
    trainer, orchestrator = r.start("trainer", *sparse, crash_at="trainer.after_step:3"), r.start("orchestrator")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    assert not r.run.checkpoint_steps("trainer")
    published = {v: load_file(r.run.weights_dir(v) / "model.safetensors") for v in (1, 2, 3)}
    trainer = r.start("trainer", "--resume", *sparse)
    r.finish(trainer, orchestrator)
    assert in_log(trainer, "no checkpoint yet") and in_log(trainer, "replaying from step 1")
    assert in_log(trainer, "version 3 was published before this trainer started: kept as it is")
    # Steps 1-3 redone, without a second record each: one record per step across the restart.
    steps = [rec["step"] for rec in r.records("trainer")]
    assert steps == list(range(1, r.max_steps + 1)), steps
    for v, tensors in published.items():  # kept, not rewritten under the servers
        again = load_file(r.run.weights_dir(v) / "model.safetensors")
        assert all(torch.equal(t, again[k]) for k, t in tensors.items()), f"version {v} changed"
    assert r.run.rollout_steps() == list(range(1, r.max_steps + 1))
    r.check_replay()  # and the replayed steps 1-3 led to the state an uninterrupted trainer has
    health = httpx.get(f"{r.url}/health", timeout=10).json()
    assert health["version"] == r.max_steps, health


def test_a_damaged_batch_file_is_rejected_and_written_again(real_run):
    """The trainer is frozen; a batch it has not read yet is truncated on disk. The thawed
    trainer sets it aside, the orchestrator writes it again, the run goes on."""
    r = real_run
    trainer, orchestrator = r.start("trainer"), r.start("orchestrator")
    r.wait_for("step 1", lambda: r.trained() >= 1, watch=(trainer, orchestrator))
    os.kill(trainer.proc.pid, signal.SIGSTOP)
    try:
        # Frozen after recording step t, it has read batch t+1 at most; batch t+2 can still be
        # made (max_async_level 1: it needs version t, which is published).
        damaged = r.trained() + 2
        assert damaged <= MAX_STEPS
        r.wait_for(f"batch {damaged}", lambda: damaged in r.run.rollout_steps(), watch=(orchestrator,))
        data = r.run.rollout_dir(damaged) / "batch.safetensors"
        intact = data.read_bytes()
        data.write_bytes(intact[: len(intact) // 2])
    finally:
        os.kill(trainer.proc.pid, signal.SIGCONT)
    r.finish(trainer, orchestrator)
    (rejected,) = (r.run.rollouts / "rejected").iterdir()
    assert rejected.name == f"step_{damaged}.1"
    assert "checksum mismatch" in (rejected / "REJECTED").read_text()
    assert in_log(orchestrator, f"batch {damaged} is gone from")
    assert (r.run.rollout_dir(damaged) / "batch.safetensors").read_bytes() == intact
    r.check_complete()
