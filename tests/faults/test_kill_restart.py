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
    run = RealRun(tmp, port, **getattr(request, "param", {}))  # indirect: RealRun's keywords
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


# The three points in one run (one trainer and orchestrator start for all three, not three of each):
# each kill hits the orchestrator the previous kill's successor is, at the next batch.
HANDOVER_KILLS = {"orchestrator.checkpointed": 2, "batch.staged": 3, "orchestrator.handed_over": 4}


def test_orchestrator_killed_while_handing_a_batch_over_resumes_without_a_gap(real_run):
    """Killed with batch k checkpointed but not written, or written but not renamed into place
    (it never existed: the restarted orchestrator hands the checkpointed bytes over), or handed
    over (it continues after it). Either way no prompt is used twice or lost (check_complete)."""
    r = real_run
    trainer = r.start("trainer")
    for point, k in HANDOVER_KILLS.items():
        orchestrator = r.start("orchestrator", crash_at=f"{point}:{k}")
        assert orchestrator.wait(240) == -signal.SIGKILL, (point, orchestrator.tail())
        assert k in r.run.checkpoint_steps("orchestrator"), point
        if point == "batch.staged":
            assert list(r.run.rollouts.glob(f".step_{k}.*")), "the crash point was not inside the batch write"
        assert (k in r.run.rollout_steps()) == (point == "orchestrator.handed_over"), point
        records = [rec["step"] for rec in r.records("orchestrator")]
        assert records == list(range(1, k)), f"batch {k}'s record before its kill at {point}: {records}"
    orchestrator = r.start("orchestrator")
    r.finish(trainer, orchestrator)
    r.check_complete()  # each killed batch's record included, once
    recovered = [rec.get("recovered") for rec in r.records("orchestrator")]
    assert recovered == [True if step in HANDOVER_KILLS.values() else None for step in range(1, r.max_steps + 1)]


# --- the trainer -----------------------------------------------------------------------------


# Four kills of the trainer in one run (one orchestrator start and one run for the four, not four
# of each; steps cost well under a second each): at steps 3, 5, 6 and 7, and a step after them.
CHAIN_STEPS = 8


@pytest.mark.parametrize("real_run", [{"max_steps": CHAIN_STEPS}], ids=["chain"], indirect=True)
def test_trainer_killed_at_any_point_resumes_and_ends_where_an_uninterrupted_trainer_does(real_run):
    """Each kill hits the previous kill's successor:
    - between steps 3 and 4, before its first checkpoint (checkpoint_every 50): --resume starts
      again at step 1 from the base model on the kept batches, and keeps the versions the killed
      trainer published as they are (its successors checkpoint every step, the run's config);
    - mid weights write of version 5: reported by the orchestrator, resumed from step 4;
    - with step 6 checkpointed but its metrics record not written: the resumed trainer writes the
      record the checkpoint kept (marked recovered), so every step has exactly one;
    - between steps 7 and 8: resumed at the next batch.
    At the end a fresh trainer replaying the run's batches ends on the same weights."""
    r = real_run
    sparse = ("--checkpoints.every", "50")
    trainer, orchestrator = r.start("trainer", *sparse, crash_at="trainer.after_step:3"), r.start("orchestrator")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    assert not r.run.checkpoint_steps("trainer")
    published = {v: load_file(r.run.weights_dir(v) / "model.safetensors") for v in (1, 2, 3)}

    silent = orchestrator.log.read_text(errors="replace").count("trainer silent for")  # the first kill's, if any
    trainer = r.start("trainer", "--resume", crash_at="weights.staged:5")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    killed = time.monotonic()
    assert in_log(trainer, "no checkpoint yet") and in_log(trainer, "replaying from step 1")
    assert in_log(trainer, "version 3 was published before this trainer started: kept as it is")
    assert (r.run.weights / ".step_5.tmp").is_dir() and 5 not in r.run.weight_steps()
    r.wait_for("the orchestrator to report the trainer",
               lambda: orchestrator.log.read_text(errors="replace").count("trainer silent for") > silent,
               timeout=45, watch=(orchestrator,))
    reported = time.monotonic() - killed
    print(f"reported after {reported:.1f} s")
    assert reported < REPORTED_WITHIN_S

    trainer = r.start("trainer", "--resume", crash_at="trainer.checkpointed:6")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    assert in_log(trainer, "resumed from checkpoints/step_4: next batch is 5")
    # Steps 1-3 redone, without a second record each: one record per step across the restarts.
    assert [rec["step"] for rec in r.records("trainer")] == [1, 2, 3, 4, 5]

    trainer = r.start("trainer", "--resume", crash_at="trainer.after_step:7")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    assert in_log(trainer, "resumed from checkpoints/step_6: next batch is 7")

    trainer = r.start("trainer", "--resume")
    r.finish(trainer, orchestrator)
    assert in_log(trainer, "resumed from checkpoints/step_7: next batch is 8")
    r.check_complete()  # trainer records 1..8, once each, in order; every batch kept
    step6 = r.records("trainer")[5]
    assert step6["recovered"] is True and step6["loss_tokens"] > 0 and "loss" in step6, step6
    for v, tensors in published.items():  # kept, not rewritten under the servers
        again = load_file(r.run.weights_dir(v) / "model.safetensors")
        assert all(torch.equal(t, again[k]) for k, t in tensors.items()), f"version {v} changed"
    r.check_replay()  # and the replayed and resumed steps led to the state an uninterrupted trainer has
    health = httpx.get(f"{r.url}/health", timeout=10).json()
    assert health["version"] == r.max_steps, health


@pytest.mark.parametrize("real_run", [{"extra": f'[transport]\nkind = "zmq"\naddress = "tcp://127.0.0.1:{free_port()}"\n'}],
                         ids=["zmq"], indirect=True)
def test_trainer_killed_between_steps_resumes_at_the_next_batch(real_run):
    """Over ZMQ the batches queued for the dead trainer died with it: the orchestrator sees a new
    trainer instance (its heartbeat) and sends every untrained batch again. (The same kill over
    the filesystem transport: the test above, its last kill.)"""
    r = real_run
    trainer, orchestrator = r.start("trainer", crash_at="trainer.after_step:3"), r.start("orchestrator")
    assert trainer.wait(240) == -signal.SIGKILL, trainer.tail()
    trainer = r.start("trainer", "--resume")
    r.finish(trainer, orchestrator)
    assert in_log(trainer, "resumed from checkpoints/step_3: next batch is 4")
    r.check_complete()


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
