"""Running asyncrl as a user does (`rl run @ config --overrides`) and reading what it measured
(metrics.jsonl), for the benchmarks that compare whole runs. One run at a time: the three programs
need both of this machine's cores.
"""

from __future__ import annotations

import json
import statistics
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from process_tree import Sampler

ROOT = Path(__file__).resolve().parents[1]
RL = Path(sys.executable).parent / "rl"
LONG_MODEL = ROOT / "models" / "long-count"
# The generation-heavy model, built once and kept (its recipe: configs/sft_long_count.toml).
LONG_BUILD = ["--task", "count", "--out", str(LONG_MODEL), "--run", str(ROOT / "runs" / "sft_long_count")]


def ensure_long_model() -> Path:
    if not (LONG_MODEL / "model.safetensors").exists():
        print(f"building {LONG_MODEL} (once, a few minutes)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), *LONG_BUILD],
                       check=True, cwd=ROOT)
    return LONG_MODEL


def run_rl(config: str, output_dir: Path, overrides: list[str], timeout_s: float,
           cpu_s: dict[str, float] | None = None, stop_after_s: float | None = None) -> tuple[float, list[dict]]:
    """`rl run` from a clean output_dir; (wall seconds, metrics records, each with "since_launch"
    seconds). Raises on a failed run. `cpu_s`, when given, is filled with each program's CPU
    seconds (the inference server and its engine core apart: benchmarks/process_tree.py).
    `stop_after_s`: a wall budget; a run still going then is stopped as Ctrl-C stops it (its
    records so far are the result)."""
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [str(RL), "run", "@", config, "--output_dir", str(output_dir), *overrides]
    print("$", " ".join(argv[1:]), flush=True)
    start, launched = time.perf_counter(), time.time()
    with open(output_dir.parent / f"{output_dir.name}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        sampler = Sampler(proc.pid, every_s=0.5, split_engine=True) if cpu_s is not None else None
        if sampler is not None:
            sampler.start()
        try:
            if stop_after_s is not None:
                try:
                    proc.wait(timeout=stop_after_s)
                except subprocess.TimeoutExpired:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=60)
                    proc.returncode = 0  # stopped on purpose
            returncode = proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()  # its programs follow it (they die with their parent)
                proc.wait()
            if sampler is not None:
                sampler.stop.set()
    wall = time.perf_counter() - start
    if sampler is not None:
        sampler.join()
        cpu_s.update({k: round(v, 2) for k, v in sampler.cpu_s.items()})
    if returncode != 0:
        raise RuntimeError(f"rl run exited {returncode}: see {output_dir.parent / output_dir.name}.log")
    records = read_metrics(output_dir)
    for r in records:  # the records' wall clock, as seconds from launch
        r["since_launch"] = r["time"] - launched
    return wall, records


def read_metrics(output_dir: Path) -> list[dict]:
    files = list(output_dir.glob("**/metrics.jsonl"))
    if not files:
        raise RuntimeError(f"no metrics.jsonl under {output_dir}")
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def window(records: list[dict], skip: int, samples_per_step: int) -> dict:
    """Rates over trainer steps after the first `skip` (engine warm-up, first reload): steps/s,
    the trainer's idle fraction (waiting for batches), the inference servers' idle fraction (no
    request in flight, as the orchestrator sees it), completions/s and completion tokens/s."""
    trainer = [r for r in records if r["program"] == "trainer"]
    orch = {r["step"]: r for r in records if r["program"] == "orchestrator"}
    if len(trainer) <= skip + 1:
        raise RuntimeError(f"only {len(trainer)} trainer steps: nothing left after skipping {skip}")
    first, rest = trainer[skip], trainer[skip + 1:]
    span = rest[-1]["time"] - first["time"]
    steps = [orch[r["step"]] for r in rest if r["step"] in orch]
    # Each orchestrator record covers the time since the previous one: weight its idle fraction
    # by that interval.
    times = {r["step"]: r["time"] for r in orch.values()}
    idle = weight = 0.0
    for r in steps:
        prev = times.get(r["step"] - 1)
        if prev is not None:
            idle += r["inference_idle_frac"] * (r["time"] - prev)
            weight += r["time"] - prev
    return {
        "steps": len(rest), "seconds": span, "steps_per_s": len(rest) / span,
        "trainer_idle_frac": sum(r["wait_s"] for r in rest) / span,
        "inference_idle_frac": idle / weight if weight else None,
        "completions_per_s": len(rest) * samples_per_step / span,
        "completion_tokens_per_s": sum(r["loss_tokens"] for r in rest) / span,
        "mean_completion_tokens": sum(r["loss_tokens"] for r in rest) / (len(rest) * samples_per_step),
        "reward_first": orch[min(orch)]["reward_mean"], "reward_last": orch[max(orch)]["reward_mean"],
        "staleness_mean": sum(r["staleness_mean"] for r in steps) / len(steps) if steps else None,
    }


def trainer_means(wall: float, records: list[dict], keys: list[str], skip: int = 20) -> dict:
    """A run's wall seconds, s/step and the mean of each trainer metric in `keys` over trainer
    steps `skip` on, with the policy's reward (`reward_sampled_mean`) over the first and last 20
    orchestrator steps."""
    trainer = [r for r in records if r["program"] == "trainer"][skip:]
    orch = [r["reward_sampled_mean"] for r in records if r["program"] == "orchestrator" and "reward_sampled_mean" in r]
    span = trainer[-1]["time"] - trainer[0]["time"]
    return {"wall_s": round(wall, 1), "s_per_step": round(span / (len(trainer) - 1), 3),
            **{k: statistics.fmean(r[k] for r in trainer) for k in keys},
            "reward_first20": statistics.fmean(orch[:20]), "reward_last20": statistics.fmean(orch[-20:])}


def save_results(name: str, args, runs: list[dict]) -> Path:
    """benchmarks/results/<name>.json: the arguments and each run's summary."""
    path = ROOT / "benchmarks" / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1, default=str) + "\n")
    return path


def print_table(header: list[str], rows: list[list]) -> None:
    """A markdown table, as docs/ quote it."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
