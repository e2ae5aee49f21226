"""How many generation requests per second the orchestrator schedules when inference costs
nothing: a null server (tests/fake_inference.py, zero latency, in its own process) and a
stand-in trainer that publishes a version per batch at once. Everything the orchestrator does per
group is in the loop: routing, request building, response validation, detokenising, rewards,
advantages, staleness checks, batch encoding and handover, checkpoints.

    .venv/bin/python benchmarks/orchestrator_throughput.py [--steps 200] [--servers 2]

Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402

from conftest import TINY_MODEL, free_port  # noqa: E402
from orchestrator.main import tune_gc  # noqa: E402
from orchestrator.orchestrator import Orchestrator  # noqa: E402
from rl.config import RunConfig  # noqa: E402
from rl.rundir import RunDir  # noqa: E402
from test_scheduling import fake_trainer  # noqa: E402


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"null server {url} did not come up")


async def bench(args, root: Path, urls: list[str]) -> dict:
    cfg = RunConfig.model_validate({
        "model": str(TINY_MODEL), "output_dir": str(root), "seq_len": 64, "max_steps": args.steps,
        "max_async_level": 2,
        "orchestrator": {"servers": {"urls": urls},
                         "datasets": [{"name": "data", "function": "fake_inference:dataset",
                                       "reward": "fake_inference:reward"}],
                         "scheduling": {"prompts_per_step": args.prompts, "group_size": args.group_size,
                                        "max_in_flight_groups": args.in_flight, "poll_interval_s": 0.02},
                         "sampling": {"max_tokens": 8}, "reward_inline": args.reward_inline},
    })
    run = RunDir(root)
    run.make()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        orch = Orchestrator(cfg, session)
        tune_gc()  # as `rl orchestrator` does
        trainer = asyncio.create_task(fake_trainer(run, args.steps, lambda: 0.0))
        start = time.perf_counter()
        await orch.run()
        seconds = time.perf_counter() - start
        await trainer
    groups = args.steps * args.prompts
    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    trainer_wait = sum(r["trainer_wait_frac"] for r in records) / len(records)
    return {"seconds": seconds, "requests_per_s": groups / seconds,
            "samples_per_s": groups * args.group_size / seconds, "trainer_wait_frac": trainer_wait}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--reward-inline", action="store_true", help="orchestrator.reward_inline = true")
    args = p.parse_args()
    ports = [free_port() for _ in range(args.servers)]
    servers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_inference.py"), str(port)],
                                env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}"}) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for u in urls:
            asyncio.run(wait_up(u))
        with tempfile.TemporaryDirectory() as tmp:
            r = asyncio.run(bench(args, Path(tmp), urls))
    finally:
        for s in servers:
            s.kill()
    print(f"{args.steps} steps x {args.prompts} groups x {args.group_size} samples, {args.servers} null server(s), "
          f"reward {'inline' if args.reward_inline else 'in a thread'}: "
          f"{r['requests_per_s']:.0f} requests/s ({r['samples_per_s']:.0f} samples/s) in {r['seconds']:.1f} s; "
          f"waiting on the stand-in trainer {100 * r['trainer_wait_frac']:.0f}% of the time")


if __name__ == "__main__":
    main()
