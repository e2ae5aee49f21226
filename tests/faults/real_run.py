"""A real run for the fault tests: real vLLM, the real trainer and the real orchestrator, as
separate programs in one run directory, started, killed and restarted the way a person would
(the trainer with --resume).

Every case ends with the same checks (RealRun.check_complete): the run reached max_steps; the
trainer trained every step exactly once, in order, and each version was published once; every
batch on disk respects the async bound; every prompt drawn is in one batch or pending in the
orchestrator's final checkpoint, none in two; nothing half-written is left behind.

The cases live in three files (orchestrator and trainer kills against one shared server; the
server itself killed; `rl run` and its children) so that test workers can run them side by side.
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
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL, rl_command
from orchestrator.prompts.queue import decode_state
from tasks import reverse
from orchestrator.rendering.tokenizer import load_tokenizer
from rl.batch import Batch
from rl.rundir import RunDir
from programs import Program
from trainer_runs import run_trainer

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
            f"timeouts.heartbeat_s = {HEARTBEAT_TIMEOUT_S}\n"
            f'[inference]\nport = {port}\ndtype = "float32"\n'
            f"[orchestrator]\nscheduling.prompts_per_step = 4\nscheduling.group_size = {GROUP_SIZE}\n"
            "scheduling.max_in_flight_groups = 8\nsampling.max_tokens = 12\n"
            # Every step checkpointed: a restarted trainer redoes no published step.
            "[checkpoints]\nevery = 1\n[trainer]\nfiles.keep_weights = 100\nfiles.keep_rollouts = 100\ntorch_threads = 1\n"
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
        state = self.run.checkpoint_dir(last) / "orchestrator" / "state.json"
        step, cursor, pending, _ = decode_state(state.read_bytes())
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
