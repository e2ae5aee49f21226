"""The GPU check's memory-share item (issue 60, item 4): a 2-step `rl run` on one GPU the server
and the trainer share, with a KL reference model and the share rl/gpu_placement.py chooses, and
what each program actually reaches (nvidia-smi's per-process memory, sampled every half second,
each process counted with the program it descends from) against the model's figures: the
trainer's need plus its CUDA context, the server's share plus its context and the reload's copy
of the largest tensor, and the GPU's peak against its memory. PASS when no program goes beyond
what the model leaves it; the metrics (measured, modelled, their ratio) are the figures
docs/performance.md records. GPU only (on CPU: SKIP); pending until a GPU is lent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

from gpu_check_items import CheckFailed, Context, last_line, merged, records, write_config, write_task
from gpu_check_processes import nvidia_smi

PROGRAMS = ("inference", "trainer")


def program_of(pid: int, launcher: int) -> str | None:
    """Which of `rl run`'s programs a process belongs to: the first ancestor below the launcher
    whose command line names one (vLLM's engine core and torchrun's ranks descend from theirs)."""
    while pid > 1 and pid != launcher:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        words = [w.decode(errors="replace") for w in cmdline]
        if parent == launcher:
            return next((p for p in PROGRAMS if p in words), None)
        pid = parent
    return None


class ProgramPeaks(threading.Thread):
    """Per-program peaks of GPU memory (MiB) below `launcher`, and the GPU's own peak."""

    def __init__(self, launcher: int):
        super().__init__(daemon=True)
        self.launcher, self.peaks, self.gpu_peak = launcher, dict.fromkeys(PROGRAMS, 0.0), 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            now = dict.fromkeys(PROGRAMS, 0.0)
            for row in nvidia_smi("--query-compute-apps=pid,used_memory") or []:
                if len(row) == 2 and row[0].isdigit():
                    program = program_of(int(row[0]), self.launcher)
                    if program:
                        now[program] += float(row[1])
            for program, mib in now.items():
                self.peaks[program] = max(self.peaks[program], mib)
            used = nvidia_smi("--query-gpu=memory.used")
            if used and used[0]:
                self.gpu_peak = max(self.gpu_peak, float(used[0][0]))

    def stop(self) -> None:
        self.done.set()
        self.join()


def modelled(config: Path, total_gib: float) -> dict[str, float]:
    """The model's figures for this run (GiB): what the trainer may reach, what the server may."""
    from rl import gpu_placement as gp
    from rl.config import load_config

    cfg = load_config(["@", str(config)])[0]
    shape = gp.model_shape(Path(cfg.model))
    plan = gp.plan(cfg, ("0",), total_gib, shape)
    share = plan.memory_share if plan.memory_share is not None else cfg.inference.gpu_memory_utilization
    trainer = sum(gp.trainer_need(cfg, shape).values()) + gp.CUDA_CONTEXT_GIB
    server = share * total_gib + gp.CUDA_CONTEXT_GIB + shape.largest_tensor_bytes / 2**30
    return {"share": share, "trainer_gib": trainer, "server_gib": server, "total_gib": total_gib}


def verdict(measured: dict[str, float], model: dict[str, float]) -> tuple[bool, str]:
    """Whether each program stayed within what the model gives it, and the line that says so."""
    over = [f"{p} reached {measured[p]:.1f} GiB, modelled {model[p + '_gib']:.1f}"
            for p in ("trainer", "server") if measured[p] > model[p + "_gib"]]
    if measured["gpu"] > model["total_gib"]:
        over.append(f"the GPU reached {measured['gpu']:.1f} of {model['total_gib']:.1f} GiB")
    line = (f"share {model['share']:.2f}: trainer {measured['trainer']:.1f} of {model['trainer_gib']:.1f} GiB "
            f"modelled, server {measured['server']:.1f} of {model['server_gib']:.1f}, GPU peak "
            f"{measured['gpu']:.1f} of {model['total_gib']:.1f}")
    return not over, ("; ".join(over) + f" ({line})") if over else line


def check_memory_share(ctx: Context) -> tuple[str, dict]:
    from rl.gpu_placement import gpu_memory_gib

    s, root = ctx.scale, ctx.path / "run"
    orchestrator = {"scheduling": {"prompts_per_step": s.prompts_per_step, "group_size": s.group_size},
                    "sampling": {"max_tokens": s.max_tokens}, "datasets": [write_task(ctx.path)]}
    extra = {"max_steps": 2, "max_async_level": 1, "orchestrator": orchestrator,
             "trainer": {"optim": {"lr": s.lr}, "loss": {"kl_coef": 0.01, "kl_target": "reference"}}}
    config = write_config(ctx.path / "run.toml", ctx, root, extra, port=ctx.ports[0])
    doc = tomllib.loads(config.read_text())
    doc["inference"].pop("gpu_memory_utilization", None)  # the share the placement chooses
    import tomli_w

    config.write_text(tomli_w.dumps(merged(doc, {})))
    env = {**ctx.gpu_env(), "PYTHONPATH": os.pathsep.join([str(ctx.path), os.environ.get("PYTHONPATH", "")])}
    total = gpu_memory_gib(0)
    if total is None:
        raise CheckFailed("torch sees no GPU in a child with CUDA_VISIBLE_DEVICES=" + env["CUDA_VISIBLE_DEVICES"])
    log = ctx.path / "rl_run.log"
    with open(log, "ab") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", "@", str(config)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ctx.path)
        peaks = ProgramPeaks(launcher.pid)
        peaks.start()
        try:
            rc = launcher.wait(timeout=840)
        finally:
            peaks.stop()
    if rc != 0:
        raise CheckFailed(f"rl run exited {rc}: {last_line(log)}", log)
    if sorted({r["step"] for r in records(root, "trainer")}) != [1, 2]:
        raise CheckFailed("the trainer did not record steps 1 and 2", log)
    measured = {"trainer": peaks.peaks["trainer"] / 1024, "server": peaks.peaks["inference"] / 1024,
                "gpu": peaks.gpu_peak / 1024}
    model = modelled(config, total)
    ok, line = verdict(measured, model)
    metrics = {"measured_gib": measured, "modelled": model,
               "ratio": {p: measured[p] / model[p + "_gib"] for p in ("trainer", "server")}}
    if not ok:
        raise CheckFailed("the memory model is short: " + line, log)
    return line, metrics
