"""Adapter sync vs full-weight sync on the same base model, against a real vLLM server.

    .venv/bin/python benchmarks/weight_sync_lora.py [--shape tiny|0.5b] [--rank 16] [--repeats 5]

One version's trip from the trainer's tensors to "the server samples with it", as the run
makes it (filesystem weight sync, no FSDP gather: one rank):
  full:    trainer/weights.py write_weights (safetensors + config + tokenizer, fsync, STABLE), then
           POST /update_weights (pause, reload in place, tied lm_head re-pack, resume);
  adapter: trainer/weights.py write_adapter (adapter_model.safetensors + adapter_config.json),
           then POST /load_lora_adapter, and the previous version's /unload_lora_adapter.
The server is `rl inference` with LoRA enabled (max_lora_rank >= rank), idle. Results:
benchmarks/results/weight_sync_lora_<shape>.json and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rl.config import LoRAConfig  # noqa: E402
from rl.rundir import RunDir  # noqa: E402
from trainer.lora import LoRA  # noqa: E402
from trainer.weights import write_adapter, write_weights  # noqa: E402
from trainer_step import build_model  # noqa: E402

TINY = ROOT / "models" / "tiny-reverse"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, run: RunDir, rank: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = run.root.parent / "server.toml"
    cfg.write_text(f'model = "{model}"\noutput_dir = "{run.root}"\nseq_len = 256\n'
                   f'[inference]\nport = {port}\ndtype = "float32"\nmax_loras = 2\n'
                   f"[trainer.lora]\nrank = {rank}\n")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "inference", "@", str(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not come up")


def model_for(shape: str, tmp: Path) -> Path:
    """The tiny demo model, or a random 0.5B-class one built under tmp."""
    if shape == "tiny":
        return TINY
    model_dir = build_model("0.5b", tmp / "model")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # vLLM wants one; ids are all we send
        shutil.copy2(TINY / f, model_dir / f)
    return model_dir


def post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(f"{url}{route}", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.5b"], default="tiny")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        tmp = Path(d)
        model_dir = model_for(args.shape, tmp)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        lora = LoRA(model, LoRAConfig(rank=args.rank, alpha=2 * args.rank), slots=1)
        lora.reset(0, seed=0)
        with torch.no_grad():
            for name, p in lora.params(0).items():
                if name.endswith("lora_B"):
                    p.normal_(0, 0.01)
        adapter = lora.gather(0)
        peft_config = lora.peft_config(str(model_dir))
        run = RunDir(tmp / "run")
        run.make()
        proc, url = start_server(model_dir, run, args.rank, tmp / "server.log")
        full, adapted = [], []
        try:
            # Interleaved, so page cache and writeback hit both alike; version numbers only grow.
            for i in range(args.repeats + 1):  # the first of each is a warm-up
                v = 2 * i + 1
                start = time.perf_counter()
                write_s = write_weights(run, v, state, model_dir, tied=True)
                reload_s = post(url, "/update_weights", {"path": str(run.weights_dir(v)), "version": v})["reload_s"]
                full.append({"write_s": write_s, "server_s": reload_s, "total_s": time.perf_counter() - start,
                             "bytes": size_of(run.weights_dir(v))})
                shutil.rmtree(run.weights_dir(v))

                v += 1
                start = time.perf_counter()
                write_s = write_adapter(run, v, adapter, peft_config)
                load_s = post(url, "/load_lora_adapter",
                              {"name": f"bench-v{v}", "path": str(run.weights_dir(v)), "version": v})["load_s"]
                total = time.perf_counter() - start
                if i:
                    post(url, "/unload_lora_adapter", {"name": f"bench-v{v - 2}"})
                adapted.append({"write_s": write_s, "server_s": load_s, "total_s": total,
                                "bytes": size_of(run.weights_dir(v))})
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    full, adapted = full[1:], adapted[1:]

    def summary(rows: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"runs": rows}

    result = {"shape": args.shape, "rank": args.rank, "repeats": args.repeats,
              "full": summary(full), "adapter": summary(adapted)}
    out = ROOT / "benchmarks" / "results" / f"weight_sync_lora_{args.shape}.json"
    out.write_text(json.dumps(result, indent=2))
    for kind in ("full", "adapter"):
        s = result[kind]
        print(f"{kind:8s} {s['bytes'] / 2**20:9.2f} MiB  write {s['write_s']:.3f} s  server {s['server_s']:.3f} s  "
              f"total {s['total_s']:.3f} s (median of {args.repeats})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
