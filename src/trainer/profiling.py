"""`trainer.profile_steps = [first, last]`: torch.profiler records those steps of `rl trainer` or
`rl sft` on every rank (CPU ops, and CUDA kernels where there is a GPU), then writes

    logs/profile_rank<R>.txt     ops sorted by their own time on the device (CPU where no GPU)
    profile/trace_rank<R>.json   a Chrome trace (chrome://tracing, ui.perfetto.dev)

and logs one line: the steps' wall time, the device's busy share of it, and the three costliest
ops. The share is the first thing to read: well under 100% on a GPU means the step waits on the
host (Python, launches, synchronising reads), and no kernel is worth tuning before that is."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("trainer")


class StepProfiler:
    def __init__(self, steps: list[int], logs: Path, traces: Path, rank: int, device: torch.device):
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        self.logs, self.traces, self.rank = logs, traces, rank
        self.cuda = device.type == "cuda"
        self.active: profile | None = None
        self.started = 0.0

    @contextlib.contextmanager
    def around(self, step: int):
        """Starts the profiler before step `first` and writes its results after step `last`
        (or after the step where it stops, if the run ends or fails inside the window)."""
        if step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.active = profile(activities=activities)
            self.active.__enter__()
            self.started = time.perf_counter()
        try:
            yield
        finally:
            if self.active is not None and step >= self.last:
                self.finish(step)

    def finish(self, step: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        prof, self.active = self.active, None
        prof.__exit__(None, None, None)
        events = prof.key_averages()
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = events.table(sort_by=key, row_limit=40)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.traces.mkdir(parents=True, exist_ok=True)
        text = self.logs / f"profile_rank{self.rank}.txt"
        text.write_text(f"steps {self.first}-{step}, {wall:.3f} s wall\n{table}\n")
        prof.export_chrome_trace(str(self.traces / f"trace_rank{self.rank}.json"))
        busy = sum(getattr(e, key) for e in events) / 1e6  # microseconds -> seconds
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:3]
        log.info("profile of steps %d-%d (rank %d): %.2f s wall, %s busy %.2f s (%.0f%%); top: %s; %s",
                 self.first, step, self.rank, wall, "device" if self.cuda else "CPU", busy, 100 * busy / wall,
                 ", ".join(f"{e.key} {getattr(e, key) / 1e6:.2f} s" for e in top), text)
