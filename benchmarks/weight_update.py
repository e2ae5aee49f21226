"""A new version's trip from "STABLE written" to "serving on every server", against vLLM's own
in-place reload of the same files, on a real `rl inference` server (idle, CPU engine).

    .venv/bin/python benchmarks/weight_update.py [--shape tiny|0.5b] [--servers 1] [--repeats 8]

ours: the trainer's write_weights publishes weights/step_v (STABLE included; the clock starts when
      it returns); the orchestrator's own follower (Orchestrator.follow_weights' poll and
      WeightDelivery.load (orchestrator/servers/delivery.py): POST /update_weights on every server =
      pause, reload, tied lm_head fix-up (inference/worker_extension.py), prefix-cache reset,
      resume) makes every server serve v. The clock stops when the last server has answered.
vLLM: POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": step_v}} (vLLM's
      dev-mode route, enabled for this benchmark only) on every server, timed from the call: no
      discovery, no pause, and on tied models it leaves the stale lm_head (../shared/VLLM_CPU_NOTES.md).
Interleaved, alternating which goes first. Results: benchmarks/results/weight_update_<shape>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from orchestrator.servers.delivery import FileDelivery  # noqa: E402
from orchestrator.servers.pool import ServerPool  # noqa: E402
from rl.config import OrchestratorConfig  # noqa: E402
from rl.inference_api import connector  # noqa: E402
from rl.rundir import RunDir  # noqa: E402
from trainer.weights import write_weights  # noqa: E402
from weight_sync_lora import model_for, start_server  # noqa: E402


async def follow(run: RunDir, pool: ServerPool, version: int, poll_s: float) -> None:
    """The orchestrator's loop (WeightsFollower.follow, until_due: orchestrator/servers/weights_follower.py) for one version that is due."""
    while True:
        latest = run.latest_stable_weights()
        if latest is not None and latest > pool.version:
            await pool.delivery.load(latest, run.weights_dir(latest))
            if latest >= version:
                if not pool.in_rotation:
                    raise RuntimeError(f"version {latest} failed to load: see runs/bench/weight_update_*_server*.log")
                return
        await asyncio.sleep(poll_s)


async def vllm_reload(session: aiohttp.ClientSession, urls: list[str], path: Path) -> float:
    start = time.perf_counter()
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": 600}

    async def one(url: str) -> None:
        async with session.post(f"{url}/collective_rpc", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}/collective_rpc: {r.status} {await r.text()}")

    await asyncio.gather(*(one(u) for u in urls))
    return time.perf_counter() - start


async def measure(run: RunDir, urls: list[str], state: dict, model_dir: Path, repeats: int) -> dict:
    poll_s = OrchestratorConfig().poll_interval_s
    ours, theirs, writes = [], [], []
    async with aiohttp.ClientSession(connector=connector()) as session, \
            aiohttp.ClientSession(connector=connector()) as plain:
        pool = ServerPool(urls, session, token=None, retry_max_s=30,
                          delivery=lambda p: FileDelivery(p, reload_timeout_s=600, root=None, in_flight_updates=False))
        await pool.connect(60)
        for v in range(1, repeats + 2):  # the first is a warm-up (vLLM's first reload is slow)
            with torch.no_grad():
                state["model.norm.weight"].add_(1e-3)  # a new version, as a step makes
            vllm_first = v % 2 == 0
            if vllm_first and v > 1:
                # The same bytes as version v, written before v is published.
                theirs.append(await vllm_reload(plain, urls, run.weights_dir(v - 1)))
            writes.append(write_weights(run, v, state, model_dir, tied=True))
            start = time.perf_counter()
            await follow(run, pool, v, poll_s)
            ours.append(time.perf_counter() - start)
            if not vllm_first:
                theirs.append(await vllm_reload(plain, urls, run.weights_dir(v)))
            if v > 2:
                shutil.rmtree(run.weights_dir(v - 2))
    ours, theirs = ours[1:], theirs[-repeats:]
    return {"ours_s": ours, "vllm_reload_s": theirs, "write_s": writes[1:],
            "ours_median_s": statistics.median(ours), "vllm_median_s": statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs), "poll_interval_s": poll_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.5b"], default="tiny")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # for /collective_rpc, the baseline's route
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        tmp = Path(d)
        model_dir = model_for(args.shape, tmp)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        run = RunDir(tmp / "run")
        run.make()
        procs, urls = [], []
        try:
            for i in range(args.servers):
                proc, url = start_server(model_dir, run, 0, tmp / f"server{i}.log")
                procs.append(proc)
                urls.append(url)
            result = asyncio.run(measure(run, urls, state, model_dir, args.repeats))
        finally:
            for proc in procs:
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            keep = ROOT / "runs" / "bench"
            keep.mkdir(parents=True, exist_ok=True)
            for i in range(len(procs)):  # the servers' own timings (paused after, reload) are in here
                shutil.copy2(tmp / f"server{i}.log", keep / f"weight_update_{args.shape}_server{i}.log")
    result |= {"shape": args.shape, "servers": args.servers,
               "bytes": sum(t.numel() * t.element_size() for t in state.values())}
    out = ROOT / "benchmarks" / "results" / f"weight_update_{args.shape}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.shape}: STABLE -> serving {result['ours_median_s'] * 1e3:.1f} ms (median), vLLM reload_weights "
          f"{result['vllm_median_s'] * 1e3:.1f} ms: {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()
