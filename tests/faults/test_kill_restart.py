"""Kill any program at any moment, restart it, lose nothing: real vLLM, the real trainer and the
real orchestrator, as separate programs, each SIGKILLed at a chosen point and started again
the way a person would (the trainer with --resume).

Exact points (the middle of a batch or weights write, between handing a batch over and
checkpointing it, between two steps) come from crash points (src/rl/faults.py): the program
SIGKILLs itself there. "Mid-generation" needs no help: from the first batch on the orchestrator
always has groups generating.

Every case ends with the same checks (RealRun.check_complete): the run reached max_steps; the
trainer trained every step exactly once, in order, and each version was published once; every
batch on disk respects the async bound; every prompt drawn is in one batch or pending in the
orchestrator's final checkpoint, none in two; nothing half-written is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL, free_port, rl_command
from orchestrator.prompts import decode_state
from orchestrator.tasks import reverse
from orchestrator.tokenizer import load_tokenizer
from rl.batch import Batch
from rl.rundir import RunDir
from test_end_to_end import Program
from test_trainer import run_trainer

pytestmark = pytest.mark.slow

MAX_STEPS = 6
MAX_ASYNC = 1
GROUP_SIZE = 4
HEARTBEAT_TIMEOUT_S = 10
# A kill is reported once the heartbeat has not changed for HEARTBEAT_TIMEOUT_S (its last change
# was at most one beat, 2 s, before the kill), seen by a watcher that looks every second or
# more often: within the timeout + 3 s; 2 s more for a loaded machine writing its log.
REPORTED_WITHIN_S = HEARTBEAT_TIMEOUT_S + 5


class RealRun:
    """One run directory and config; programs started and restarted against it."""

    def __init__(self, tmp: Path, port: int, max_steps: int = MAX_STEPS, extra: str = ""):
        self.tmp, self.port, self.max_steps = tmp, port, max_steps
        self.run = RunDir(tmp / "run")
        self.url = f"http://127.0.0.1:{port}"
        self.cfg = tmp / "run.toml"
        self.cfg.write_text(
            f'model = "{TINY_MODEL}"\noutput_dir = "{self.run.root}"\nmax_steps = {max_steps}\nseq_len = 64\n'
            f"max_async_level = {MAX_ASYNC}\n"
            # A kill is named after this long (default 20 s): five missed beats is margin enough.
            f"heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}\n"
            f'[inference]\nport = {port}\ndtype = "float32"\n'
            f"[orchestrator]\nprompts_per_step = 4\ngroup_size = {GROUP_SIZE}\nmax_tokens = 12\nmax_in_flight_groups = 8\n"
            # Every step checkpointed: a restarted trainer redoes no published step.
            "[trainer]\ncheckpoint_every = 1\nkeep_weights = 100\nkeep_rollouts = 100\ntorch_threads = 1\n"
            "[trainer.optim]\nlr = 1e-3\n" + extra)
        self.programs: list[Program] = []

    def start(self, name: str, *extra: str, crash_at: str | None = None) -> Program:
        env = {"ASYNCRL_CRASH_AT": crash_at} if crash_at else None
        p = Program(name, self.cfg, self.tmp, extra=extra, env=env)
        self.programs.append(p)
        return p

    def start_server(self, *extra: str) -> Program:
        server = self.start("inference", *extra)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert server.proc.poll() is None, server.tail()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"server did not come up:\n{server.tail()}")

    def records(self, program: str) -> list[dict]:
        if not self.run.metrics.exists():
            return []
        return [r for line in self.run.metrics.read_text().splitlines() if line.strip()
                for r in [json.loads(line)] if r.get("program") == program]

    def wait_for(self, what: str, predicate, timeout: float = 240, watch: tuple[Program, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for p in watch:
                assert p.proc.poll() is None, f"{p.log.name} exited {p.proc.returncode} waiting for {what}:\n{p.tail()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def trained(self) -> int:
        return max((r["step"] for r in self.records("trainer")), default=0)

    def finish(self, trainer: Program, orchestrator: Program, timeout: float = 300) -> None:
        assert trainer.wait(timeout) == 0, trainer.tail()
        assert orchestrator.wait(120) == 0, orchestrator.tail()

    def stop_all(self) -> None:
        for p in self.programs:
            p.stop()

    def check_complete(self, server_running: bool = True) -> None:
        n = self.max_steps
        steps = [r["step"] for r in self.records("trainer")]
        assert steps == list(range(1, n + 1)), f"trainer steps {steps}: each step must be trained once, in order"
        assert [w for w in self.run.weight_steps()] == list(range(1, n + 1))
        for v in range(1, n + 1):
            assert (self.run.weights_dir(v) / "STABLE").exists()
        assert self.run.rollout_steps() == list(range(1, n + 1))
        for step in range(1, n + 1):
            batch = Batch.read(self.run.rollout_dir(step))
            assert batch.step == step and batch.num_samples > 0
            assert batch.versions.min() >= step - 1 - MAX_ASYNC and batch.versions.max() <= step - 1
        # One record per batch, in order, whatever was killed when (one killed before writing
        # its record has it written by its successor).
        orchestrator_steps = [r["step"] for r in self.records("orchestrator")]
        assert orchestrator_steps == list(range(1, n + 1)), f"orchestrator records {orchestrator_steps}"
        self.check_each_prompt_once()
        # Nothing half-written left visible or lying around.
        assert not list(self.run.rollouts.glob(".step_*")), list(self.run.rollouts.glob(".step_*"))
        assert not list(self.run.weights.glob(".step_*")), list(self.run.weights.glob(".step_*"))
        if server_running:
            health = httpx.get(f"{self.url}/health", timeout=10).json()
            assert health["version"] == n, health

    def check_each_prompt_once(self) -> None:
        """Every prompt in the batches is one group of group_size samples: none was trained twice
        (the task's first rows are all different, checked first); and none was lost: the
        prompts drawn (the final orchestrator checkpoint's cursor) are exactly those batched plus
        those it still holds pending, whatever was killed in between."""
        rows = list(itertools.islice(reverse.dataset(0), 500))  # the run's seed is the default, 0
        index = {row["prompt"]: i for i, row in enumerate(rows)}
        assert len(index) == len(rows)
        tokenizer = load_tokenizer(str(TINY_MODEL))
        samples = collections.Counter()
        for step in self.run.rollout_steps():
            batch = Batch.read(self.run.rollout_dir(step))
            for s in batch.sample_slices():
                mask = batch.loss_mask[s]
                samples[tokenizer.decode(batch.tokens[s][: int(mask.argmax())].tolist())] += 1
        assert set(samples.values()) == {GROUP_SIZE}, {p: n for p, n in samples.items() if n != GROUP_SIZE}
        used = sorted(index[p] for p in samples)
        last = self.run.checkpoint_steps("orchestrator")[-1]
        step, cursor, pending = decode_state((self.run.checkpoint_dir(last) / "orchestrator" / "state.json").read_bytes())
        assert step == self.max_steps
        pending_ids = [p.index for p in pending]
        assert not set(pending_ids) & set(used), "a prompt both batched and pending"
        assert sorted(used + pending_ids) == list(range(cursor)), (
            f"drawn {cursor}, batched {len(used)}, pending {len(pending_ids)}: a prompt was lost")

    def check_replay(self) -> None:
        """Each step trained once from the right state: a fresh trainer on this run's own batches
        (one rank, the same micro-batches and order) ends on the same weights, bit for bit."""
        replay = RunDir(self.tmp / "replay")
        for n in range(1, self.max_steps + 1):
            shutil.copytree(self.run.rollout_dir(n), replay.rollout_dir(n))
        run_trainer(rl_command("trainer"), ["@", str(self.cfg), "--output_dir", str(replay.root)])
        got = load_file(self.run.weights_dir(self.max_steps) / "model.safetensors")
        want = load_file(replay.weights_dir(self.max_steps) / "model.safetensors")
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), f"{k} differs from a replay of the run's batches"

    def pids(self) -> dict[str, int]:
        """{program: pid} of the programs running now, from their heartbeat files."""
        out = {}
        for path in self.run.root.joinpath("heartbeats").iterdir():
            if path.name.startswith("."):
                continue  # a heartbeat being written (write_file_atomic's temporary): gone in a moment
            name = "inference" if path.name.startswith("inference-") else path.name
            out[name] = int(path.read_text().split("@", 1)[0])
        return out


def gone(pgid: int, timeout: float = 20.0) -> bool:
    """Whether every process of the group has exited (within timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def in_log(program: Program, text: str) -> bool:
    return text in program.log.read_text(errors="replace")


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


# --- the inference server --------------------------------------------------------------------


def test_inference_killed_mid_generation_leaves_no_process_and_a_restart_catches_up(tmp_path):
    """With vLLM's own worker process (inference.one_process_engine off): the most processes a
    one-worker server has, all gone with it; the run on that layout trains to the end."""
    r = RealRun(tmp_path, free_port())
    two_processes = ("--inference.one_process_engine", "false")
    try:
        server = r.start_server(*two_processes)
        trainer, orchestrator = r.start("trainer"), r.start("orchestrator")
        r.wait_for("step 2", lambda: r.trained() >= 2, watch=(trainer, orchestrator))
        layout = [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
        assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(layout), layout
        os.kill(server.proc.pid, signal.SIGKILL)  # the main process alone, as the OOM killer would
        server.proc.wait(timeout=10)  # reaped, as its parent would: what is left of its group is vLLM's
        r.wait_for("the orchestrator to report the server", lambda: in_log(orchestrator, f"server {r.url} out of rotation"),
                   timeout=30, watch=(orchestrator,))
        # vLLM's engine process does not outlive the server it belongs to.
        assert gone(server.proc.pid), subprocess.run(["ps", "-o", "pid,pgid,cmd", "-g", str(server.proc.pid)],
                                                     capture_output=True, text=True).stdout
        stalled_at = r.trained()
        r.start_server(*two_processes)
        r.finish(trainer, orchestrator)
        assert stalled_at < MAX_STEPS, "the run did not need the restarted server"
        assert in_log(orchestrator, f"server {r.url} back in rotation")
        r.check_complete()
    finally:
        r.stop_all()


# --- rl run ----------------------------------------------------------------------------------


@contextlib.contextmanager
def rl_run(r: RealRun, out: Path, *extra: str):
    """`rl run` in its own session, logging to `out`; its group is killed on the way out."""
    with open(out, "ab") as f:
        launcher = subprocess.Popen(rl_command("run", "@", str(r.cfg), *extra), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        yield launcher
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_rl_run_stops_everything_naming_a_frozen_trainer_and_resume_finishes(tmp_path):
    """A frozen trainer (SIGSTOP: alive, silent) makes `rl run` stop every program within
    seconds of the heartbeat timeout, exit non-zero naming it, and leave no process behind;
    `rl run --resume` then finishes the run with every step trained once."""
    r = RealRun(tmp_path, free_port())
    out = tmp_path / "rl_run.log"
    with rl_run(r, out) as launcher:
        r.wait_for("step 2", lambda: r.trained() >= 2)
        children = r.pids()
        assert set(children) == {"inference", "trainer", "orchestrator"}, children
        os.kill(children["trainer"], signal.SIGSTOP)
        assert launcher.wait(timeout=75) == 1, out.read_text()
    assert "rl run: trainer silent for" in out.read_text(), out.read_text()
    for name, pid in children.items():
        assert gone(pid, timeout=5), f"{name} (pid {pid}) outlived rl run"
    with rl_run(r, out, "--resume") as resumed:
        assert resumed.wait(timeout=400) == 0, out.read_text()[-3000:]
    r.check_complete(server_running=False)


def test_a_killed_launcher_takes_every_program_with_it(tmp_path):
    r = RealRun(tmp_path, free_port())
    with rl_run(r, tmp_path / "rl_run.log") as launcher:
        r.wait_for("step 1", lambda: r.trained() >= 1)
        children = r.pids()
        assert set(children) == {"inference", "trainer", "orchestrator"}, children
        launcher.kill()
    for name, pid in children.items():
        assert gone(pid, timeout=30), f"{name} (pid {pid}) outlived a SIGKILLed rl run"
