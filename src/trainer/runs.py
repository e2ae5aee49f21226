"""Multi-run LoRA: one trainer, several runs at once, each with its own adapter slot, optimizer,
learning-rate schedule, step counter and checkpoints (`[trainer.lora] multi_run = true`).

A run is the directory output_dir/runs/<name>/ that its orchestrator (run_name = "<name>")
works in. The trainer reads from it
    config/orchestrator.toml  the run's resolved config: its loss, optimizer, max_steps, seed
    heartbeats/orchestrator   rewritten by the orchestrator every few seconds, removed on exit
    rollouts/step_n           the run's batches
and writes into it weights/step_n (the run's adapter), checkpoints/step_n/trainer/ (adapter and
optimizer state), metrics.jsonl lines, and trainer_status.json (joined, finished, left, rejected:
what the orchestrator shows its user when the trainer turns the run away).

A run joins when its orchestrator's heartbeat is there and not silent and a slot is free,
continuing from its latest checkpoint if it has one. It leaves when it reaches max_steps, when its
next batch is missing and its orchestrator's heartbeat is gone or has not changed for
run_timeout_s (checkpointed first, so it can rejoin), or when one of its steps fails. Silence is
timed by this process's clock (rl/heartbeat.py): the hosts' clocks need not agree. The other runs never wait for it: each turn
trains one step of the run whose batch is ready and which trained least recently.

Rank 0 makes every decision (it alone looks at the directories) and hands it to the other ranks
as one JSON message per turn, so every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rl.config import ConfigError, RunConfig, load_config
from rl.heartbeat import PeerState, PeerWatch
from rl.rundir import RunDir, write_file_atomic
from rl.transport.interface import BatchReceiver
from rl.transport.registry import batch_receiver
from trainer.parallel import share_json
from trainer.policy import Policy
from trainer.trainer import Trainer

log = logging.getLogger("trainer")

POLL_S = 0.2
_SHAPE = ("rank", "alpha", "dropout", "target_modules")


@dataclass
class Member:
    policy: Policy
    receiver: BatchReceiver
    step: int
    """The next batch to train on."""
    trained_at: float


class RunRejected(Exception):
    """A run that cannot join; the message says why and names the key or file."""


class MultiRun:
    def __init__(self, trainer: Trainer):
        self.t, self.cfg = trainer, trainer.cfg
        self.lora_cfg, self.timeouts = self.cfg.trainer.lora, self.cfg.trainer.timeouts
        self.root = RunDir(self.cfg.output_dir)
        self.members: dict[str, Member] = {}
        self.free = list(range(self.lora_cfg.slots))
        # Runs not to take back: name -> the heartbeat (orchestrator instance) they were turned
        # away or finished under. A restarted orchestrator writes a new heartbeat and is looked at again.
        self.settled: dict[str, str] = {}
        self.idle_since, self.seen_any = time.monotonic(), False
        self.watches: dict[str, PeerWatch] = {}

    def orchestrator(self, name: str) -> PeerState:
        """The run's orchestrator as its heartbeat shows it (first seen now: not silent yet)."""
        watch = self.watches.get(name)
        if watch is None:
            watch = self.watches[name] = PeerWatch(self.root.run(name).heartbeat, f"run {name}'s orchestrator",
                                                   self.timeouts.run_s)
        return watch.poll()

    # --- the loop (every rank) ------------------------------------------------------------------

    def serve(self) -> None:
        if self.t.rank == 0:
            log.info("multi-run LoRA: serving the runs under %s (%d slots, rank %d)", self.root.root / "runs",
                     self.lora_cfg.slots, self.lora_cfg.rank)
        while True:
            plan = share_json(self.plan() if self.t.rank == 0 else None, self.t.device)
            for name, why, status in plan["leave"]:
                self.leave(name, why, status)
            for name in plan["join"]:
                self.join(name)
            if plan["train"]:
                self.train(plan["train"])
            elif plan["exit"]:
                log.info("no run for %.0f s (trainer.lora.idle_exit_s): exiting", self.lora_cfg.idle_exit_s)
                return
            else:
                time.sleep(POLL_S)

    def plan(self) -> dict:
        """Rank 0: who leaves, who joins, whose step comes next, and whether to exit."""
        now = time.monotonic()
        leave, ready = [], []
        for name, m in self.members.items():
            if m.policy.run.rollout_dir(m.step).is_dir():
                ready.append((m.trained_at, name))
                continue
            peer = self.orchestrator(name)
            if peer.state != "alive":
                why = ("its orchestrator stopped" if peer.state != "silent" else
                       f"no heartbeat from its orchestrator for {peer.silent_s:.0f} s (trainer.timeouts.run_s)")
                leave.append((name, f"{why}, waiting for batch {m.step}", "left"))
        join = []
        free = len(self.free) + len(leave)
        for name in self.root.runs():
            if free == 0:
                break
            run = self.root.run(name)
            if name in self.members or not run.config_file("orchestrator").is_file():
                continue
            if self.orchestrator(name).state != "alive" or (
                    name in self.settled and self.settled[name] == _instance(run)):
                continue
            join.append(name)
            free -= 1
        if self.members or join:
            self.idle_since, self.seen_any = now, True
        idle = self.lora_cfg.idle_exit_s
        exit_ = bool(idle and self.seen_any and not self.members and not join and now - self.idle_since > idle)
        return {"leave": leave, "join": join, "train": min(ready)[1] if ready else None, "exit": exit_}

    # --- joining and leaving --------------------------------------------------------------------

    def join(self, name: str) -> None:
        run = self.root.run(name)
        instance = _instance(run)
        try:
            cfg = self.run_config(run)
            slot = self.free.pop(0)
            try:
                policy = self.t.new_policy(cfg, run, slot)
                step = self.t.start_step(policy, resume=True)
            except SystemExit as e:  # start_step's refusals: weights without a checkpoint
                self.free.insert(0, slot)
                raise RunRejected(str(e)) from None
        except RunRejected as e:
            self.settled[name] = instance
            self.status(run, "rejected", str(e))
            if self.t.rank == 0:
                log.error("run %s rejected: %s", name, e)
            return
        if step > cfg.max_steps:
            self.free.insert(0, slot)
            self.settled[name] = instance
            self.status(run, "finished", f"all {cfg.max_steps} steps were trained before")
            return
        # A damaged batch fails this run alone: waiting here for a rewrite would stall every run.
        receiver = batch_receiver(cfg.transport, run, keep=bool(cfg.checkpoints.every), reject_damaged=False)
        self.members[name] = Member(policy, receiver, step, time.monotonic())
        self.status(run, "joined", f"slot {slot}, next batch {step}", slot=slot, step=step)
        if self.t.rank == 0:
            log.info("run %s joined in slot %d at step %d of %d (%d run(s) training)", name, slot, step,
                     cfg.max_steps, len(self.members))

    def run_config(self, run: RunDir) -> RunConfig:
        """The run's own config, checked against what the trainer's slots and server hold."""
        path = run.config_file("orchestrator")
        try:
            cfg, _ = load_config(["@", str(path)])
        except ConfigError as e:
            raise RunRejected(f"{path}: {e}") from None
        mine = self.cfg
        # Paths are the orchestrator's, on its host: they may name the shared directory and the
        # model differently from here. What must agree is the run's name and the model itself.
        if cfg.run_name != run.root.name:
            raise RunRejected(f"run_name: {cfg.run_name!r} is not this run's directory name {run.root.name!r}")
        if not same_model(cfg.model, mine.model):
            raise RunRejected(f"model: {cfg.model} differs from the trainer's base model {mine.model}")
        if cfg.seq_len > mine.seq_len:
            raise RunRejected(f"seq_len: {cfg.seq_len} exceeds the trainer's {mine.seq_len}")
        for key in _SHAPE:
            theirs, ours = getattr(cfg.trainer.lora, key), getattr(self.lora_cfg, key)
            if theirs != ours:
                raise RunRejected(f"trainer.lora.{key}: {theirs!r} differs from the trainer's {ours!r} "
                                  "(every slot has the trainer's shape)")
        return cfg

    def leave(self, name: str, why: str, status: str) -> None:
        m = self.members.pop(name)
        trained = m.step - 1
        # Checkpointed, so that a rejoin continues exactly here rather than from an older one.
        if status == "left" and m.policy.cfg.checkpoints.every and trained > m.policy.last_checkpoint:
            self.t.save_checkpoint(m.policy, trained)
        m.receiver.close()
        self.free.append(m.policy.slot)
        self.free.sort()
        if status != "left":
            self.settled[name] = _instance(m.policy.run)
        self.status(m.policy.run, status, why, step=trained)
        if self.t.rank == 0:
            (log.info if status != "failed" else log.error)(
                "run %s %s after step %d: %s (%d run(s) training)", name, status, trained, why, len(self.members))

    def train(self, name: str) -> None:
        m = self.members[name]
        try:
            with self.t.profiler.around(m.step):  # multi-run: the window's steps of whichever run
                self.t.train_one(m.policy, m.receiver, m.step)
        except Exception as e:  # this run's batch or config: the other runs go on
            m.policy.optimizer.zero_grad(set_to_none=True)
            self.leave(name, f"step {m.step} failed: {type(e).__name__}: {e}", "failed")
            return
        m.step += 1
        m.trained_at = time.monotonic()
        if m.step > m.policy.cfg.max_steps:
            self.leave(name, f"all {m.policy.cfg.max_steps} steps trained", "finished")

    def status(self, run: RunDir, status: str, detail: str, **extra) -> None:
        if self.t.rank == 0:
            # The orchestrator instance it concerns: a restarted orchestrator ignores its
            # predecessor's verdict without comparing clocks across hosts.
            record = {"status": status, "detail": detail, "orchestrator": _instance(run), **extra}
            write_file_atomic(run.trainer_status, json.dumps(record).encode())


def same_model(theirs: Path, mine: Path) -> bool:
    """The same directory, or (seen from another host) one whose config.json is the same."""
    if theirs.resolve() == mine.resolve():
        return True
    try:
        return json.loads((theirs / "config.json").read_text()) == json.loads((mine / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _instance(run: RunDir) -> str:
    """The orchestrator instance behind a run: its heartbeat's first line (pid and start time)."""
    try:
        return run.heartbeat.read_text().split("\n", 1)[0]
    except OSError:
        return ""
