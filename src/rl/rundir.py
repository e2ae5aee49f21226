"""The run directory: the one thing the three programs share (see docs/architecture.md).

    <output_dir>/
      config/<program>.toml   resolved config each program started with
      rollouts/step_<n>/      batch n: written under a temporary name, then renamed
      rollouts/rejected/      batches the trainer found damaged, each with REJECTED (the reason)
      weights/step_<n>/       HF safetensors + config + tokenizer, or (weight_sync broadcast)
                              broadcast.json + DELIVERED; STABLE written last
      checkpoints/step_<n>/   orchestrator/ (and trainer/) state after step n
      logs/<program>.log
      metrics.jsonl
      heartbeats/<program>    each program's liveness file (rl/heartbeat.py), removed on exit:
                              inference-<host>-<port> (carrying its URL), trainer-rank<r> too
      runs/<name>/            multi-run LoRA: one such directory per run (docs/lora.md)
      trainer_status.json     multi-run: the trainer's word on this run (joined, finished, left...)

Readers act only on complete items: a rollouts/step_<n> directory exists only once whole (rename
is atomic), and a weights directory counts only once it holds STABLE. Nothing here uses file
locks or inotify, so the protocol holds on network filesystems too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

STABLE = "STABLE"
_STEP = re.compile(r"^step_(\d+)$")


class RunDir:
    def __init__(self, root: Path | str):
        self.root = Path(root)

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    def rollout_dir(self, step: int) -> Path:
        return self.rollouts / f"step_{step}"

    def weights_dir(self, step: int) -> Path:
        return self.weights / f"step_{step}"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def checkpoint_steps(self, program: str) -> list[int]:
        """Steps with a complete checkpoint of `program`."""
        return sorted(n for n in _steps(self.checkpoints) if (self.checkpoint_dir(n) / program / STABLE).exists())

    def remove_checkpoint(self, step: int, program: str) -> None:
        """Delete `program`'s part of checkpoint step; the step's directory goes with the last part."""
        remove_quietly(self.checkpoint_dir(step) / program)
        try:
            self.checkpoint_dir(step).rmdir()
        except OSError:  # another program's part is still there
            pass

    @property
    def heartbeat_dir(self) -> Path:
        return self.root / "heartbeats"

    def heartbeat_file(self, program: str) -> Path:
        return self.heartbeat_dir / program

    @property
    def heartbeat(self) -> Path:
        """The orchestrator's: a multi-run trainer admits and keeps a run by it."""
        return self.heartbeat_file("orchestrator")

    @property
    def trainer_status(self) -> Path:
        return self.root / "trainer_status.json"

    def runs(self) -> list[str]:
        """Names of the multi-run runs under runs/."""
        parent = self.root / "runs"
        return sorted(p.name for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []

    def run(self, name: str) -> RunDir:
        return RunDir(self.root / "runs" / name)

    def config_file(self, program: str) -> Path:
        return self.root / "config" / f"{program}.toml"

    def make(self) -> None:
        for d in (self.rollouts, self.weights, self.logs, self.root / "config", self.heartbeat_dir):
            d.mkdir(parents=True, exist_ok=True)

    def stable_weight_steps(self) -> list[int]:
        """The n whose weights/step_n holds STABLE (complete), ascending."""
        return sorted(n for n in _steps(self.weights) if (self.weights_dir(n) / STABLE).exists())

    def latest_stable_weights(self) -> int | None:
        """Highest n whose weights/step_n holds STABLE, or None."""
        return max(self.stable_weight_steps(), default=None)

    def rollout_steps(self) -> list[int]:
        return sorted(_steps(self.rollouts))

    def weight_steps(self) -> list[int]:
        return sorted(_steps(self.weights))

    def append_metrics(self, record: dict) -> None:
        record = {"time": time.time(), **record}
        # One write() of one line with O_APPEND: lines from the two writers never interleave.
        with open(self.metrics, "a") as f:
            f.write(json.dumps(record) + "\n")

    def recorded_steps(self, program: str) -> set[int]:
        """Steps that `program` has a record for in metrics.jsonl: a restarted program writes
        the records its predecessor was killed before writing, and none twice."""
        if not self.metrics.exists():
            return set()
        steps = set()
        for line in self.metrics.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a full disk; nothing else writes partial lines
            if isinstance(record, dict) and record.get("program") == program and isinstance(record.get("step"), int):
                steps.add(record["step"])
        return steps


def _steps(parent: Path) -> list[int]:
    if not parent.is_dir():
        return []
    return [int(m.group(1)) for p in parent.iterdir() if (m := _STEP.match(p.name))]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, rename: readers see the old file or the whole new one."""
    # Named per process and thread: two writers of one file must not rename each other's temporary.
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make a fully written temporary directory visible under its final name in one rename."""
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def mark_stable(directory: Path) -> None:
    """Written last: everything else in the directory is complete and durable before it."""
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    write_file_atomic(directory / STABLE, b"")


def remove_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
