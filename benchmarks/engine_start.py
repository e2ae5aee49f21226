"""What one `rl inference` start costs, and how fast it then generates, with vLLM's worker in the
engine-core process (inference.one_process_engine, the default) and in a process of its own.

    .venv/bin/python benchmarks/engine_start.py [--cores 0] [--repeats 2]

For each layout: seconds from launch to /health answering 200, CPU seconds each process of the
server used until then (psutil, sampled every 0.2 s), then 64 sampled completions of 200 tokens
(ignore_eos) twice, tokens per second and the CPU they took. The engine is bound to --cores
(VLLM_CPU_OMP_THREADS_BIND, as the test suite binds one core per xdist worker).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-reverse"
REQUESTS, MAX_TOKENS = 64, 200


def cpu_of(procs: dict[int, psutil.Process]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs.values():
        try:
            name = p.name() if p.name().startswith("VLLM") else " ".join(p.cmdline()[1:4])
            t = p.cpu_times()
            out[name] = out.get(name, 0.0) + t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return out


async def generate(url: str) -> int:
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(seed: int) -> int:
            r = await client.post(f"{url}/v1/completions", json={
                "model": str(MODEL), "prompt": "abc=", "max_tokens": MAX_TOKENS, "temperature": 1,
                "seed": seed, "ignore_eos": True})
            return r.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(i) for i in range(REQUESTS))))


def measure(one_process: bool, cores: str, tmp: Path) -> dict:
    port = 18000 + os.getpid() % 1000
    cfg = tmp / "server.toml"
    cfg.write_text(f'model = "{MODEL}"\noutput_dir = "{tmp / "run"}"\nseq_len = 256\n[inference]\n'
                   f'port = {port}\ndtype = "float32"\none_process_engine = {str(one_process).lower()}\n')
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "asyncrl", "inference", "@", str(cfg)],
                              stdout=open(tmp / "server.log", "wb"), stderr=subprocess.STDOUT,
                              env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores})
    procs: dict[int, psutil.Process] = {}
    try:
        while True:
            assert server.poll() is None, (tmp / "server.log").read_text()[-2000:]
            root = psutil.Process(server.pid)
            for p in [root, *root.children(recursive=True)]:
                procs.setdefault(p.pid, p)
            start_cpu = cpu_of(procs)  # the last look before it answers
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        ready_s = time.monotonic() - started
        rates = []
        for _ in range(2):  # the first round includes the engine's slower first batches
            before, t0 = sum(cpu_of(procs).values()), time.monotonic()
            tokens = asyncio.run(generate(url))
            rates.append((tokens / (time.monotonic() - t0), sum(cpu_of(procs).values()) - before))
        return {"ready_s": ready_s, "start_cpu": start_cpu, "rates": rates}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND for the engine")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for one_process in (True, False):
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                m = measure(one_process, args.cores, Path(tmp))
            layout = "one process " if one_process else "worker apart"
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in sorted(m["start_cpu"].items()) if v >= 0.05)
            rates = ", ".join(f"{tps:.0f} tok/s ({c:.1f} CPU s)" for tps, c in m["rates"])
            print(f"{layout}: ready in {m['ready_s']:.1f} s, start CPU {sum(m['start_cpu'].values()):.1f} s "
                  f"[{cpu}]; {REQUESTS}x{MAX_TOKENS} tokens: {rates}", flush=True)


if __name__ == "__main__":
    main()
