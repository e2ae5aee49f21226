"""Experiment trackers (`[tracking]`): wandb and TensorBoard, fed from metrics.jsonl, which stays
the source of truth. One code path: `Tracker.forward()` reads the records appended since its last
call (the orchestrator's, the trainer's, evaluations) and hands each to every sink. The
orchestrator runs it, so tracking works the same under `rl run` and with the programs started by
hand (`rl sft`, which has no orchestrator, runs it beside its trainer: `following`); where it
got to in metrics.jsonl is kept in tracking/offset, so a restarted orchestrator neither loses nor
repeats records, and wandb resumes the same run (tracking/wandb_id).

A sink that fails logs one warning and is dropped; the run goes on.

Keys: "<program>/<field>" (orchestrator/reward_mean, trainer/loss); eval records keep their own
"eval/<dataset>/<metric>". Only numbers are sent (the staleness histogram is a dict: skipped).
wandb charts use the run's step ("step") as x-axis, so the two programs' records may arrive in any
order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Protocol

from rl.config import RunConfig, to_toml_dict
from rl.rundir import RunDir, write_file_atomic

log = logging.getLogger("tracking")


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    def __init__(self, cfg: RunConfig, directory: Path):
        import wandb

        t = cfg.tracking
        id_file = directory / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        write_file_atomic(id_file, run_id.encode())
        mode = t.wandb_mode
        if mode == "auto":  # online only where a key is configured: a laptop without one still tracks
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.run = wandb.init(project=t.wandb_project, entity=t.wandb_entity, name=t.run_name or cfg.run_dir.name,
                              id=run_id, resume="allow", mode=mode, dir=str(directory),
                              config=to_toml_dict(cfg), settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    def __init__(self, directory: Path):
        from tensorboard.summary import Writer  # tensorboard's own writer: no torch import

        self.writer = Writer(str(directory / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def flatten(record: dict) -> tuple[int, dict[str, float]] | None:
    """(step, numeric values keyed for the trackers), or None for a record without a step."""
    step = record.get("step")
    if not isinstance(step, int):
        return None
    program = record.get("program", "run")
    values = {}
    for key, value in record.items():
        # time: the wall clock, which the trackers keep themselves.
        if key in ("step", "program", "run", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values[key if key.startswith("eval/") else f"{program}/{key}"] = float(value)
    return step, values


class Tracker:
    def __init__(self, cfg: RunConfig):
        self.run = RunDir(cfg.run_dir)
        self.directory = self.run.root / "tracking"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.offset_file = self.directory / "offset"
        self.offset = int(self.offset_file.read_text()) if self.offset_file.exists() else 0
        self.sinks: dict[str, Sink] = {}
        # forward() runs in a worker thread every 2 s and close() in another at the end: one at a
        # time, or two would read from the same offset and send the same records twice.
        self.lock = threading.Lock()
        t = cfg.tracking
        for name, wanted, make in (("wandb", t.wandb, lambda: WandbSink(cfg, self.directory)),
                                   ("tensorboard", t.tensorboard, lambda: TensorBoardSink(self.directory))):
            if wanted:
                try:
                    self.sinks[name] = make()
                except Exception as e:
                    log.warning("tracking: %s could not start (%s: %s); the run goes on without it",
                                name, type(e).__name__, e)

    def forward(self) -> int:
        """Send the records appended since the last call to every sink; returns how many."""
        with self.lock:
            return self._forward()

    def _forward(self) -> int:
        if not self.sinks or not self.run.metrics.exists():
            return 0
        with open(self.run.metrics, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        for record in records:
            flat = flatten(record)
            if flat is not None:
                self._send(*flat)
        self.offset += end
        write_file_atomic(self.offset_file, str(self.offset).encode())
        return len(records)

    def _send(self, step: int, values: dict[str, float]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(step, values)
            except Exception as e:
                log.warning("tracking: %s failed (%s: %s); no more records go to it", name, type(e).__name__, e)
                del self.sinks[name]

    def close(self) -> None:
        with self.lock:
            self._forward()
            for name, sink in self.sinks.items():
                try:
                    sink.close()
                except Exception as e:
                    log.warning("tracking: closing %s failed (%s: %s)", name, type(e).__name__, e)
            self.sinks = {}


@contextlib.contextmanager
def following(cfg: RunConfig, every_s: float = 2.0):
    """With wandb or TensorBoard on: forward metrics.jsonl every `every_s` from a daemon thread
    while the body runs, then the rest and close. Off: nothing."""
    if not (cfg.tracking.wandb or cfg.tracking.tensorboard):
        yield
        return
    tracker, done = Tracker(cfg), threading.Event()

    def loop() -> None:
        while not done.wait(every_s):
            tracker.forward()

    thread = threading.Thread(target=loop, name="tracking", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        tracker.close()
