"""What a version costs with weight deltas (`[weight_sync] delta = true`) against full files, per
update: bytes written (= bytes each inference host reads), trainer seconds to publish, server
seconds to apply, and vLLM's own reload of the full file (issue 54, item 5).

    .venv/bin/python benchmarks/weight_delta_update.py --shape 0.5b --steps 4 --server   # ~10 min, ~12 GB
    .venv/bin/python benchmarks/weight_delta_update.py --shape 1.5b --steps 4            # no server: ~20 GB
    .venv/bin/python benchmarks/weight_delta_update.py table

Weights: random, in Qwen2.5-0.5B's or 1.5B's shape (tied embeddings, bfloat16 served), from
float32 masters with transformers' Qwen2 init (benchmarks/weight_delta.py init_tensor). Each step
moves every master value by +-lr (a random sign): the most one AdamW step can move it (its first
step on any gradient above eps; weight_delta.py's "sim"), so the share of bf16 values that
change is an upper bound for the lr. The masters are not kept: a version's values are recomputed
per tensor from seeds, which keeps the 1.5B shape inside this machine's memory.

Version 1 is full (the base); versions 2..steps+1 are deltas against it (k = 1..steps steps
from the base), as trainer/deltas.py publishes them with weight_sync.full_every > steps. Per
version:
  delta publish   FilePublisher.deliver (trainer/publish.py): bit compare against the base, the
                  result's checksum, delta.safetensors + delta.json written aside, STABLE, rename
  full publish    the same version as a full directory, as with delta = false (write_weights,
                  no digest)
  bytes           each directory's size: what the trainer writes, and what every inference host
                  reads for it (multi-host: each host reads the delta; a host reads the base's
                  full file only once per full version, or when it joins late)
With --server (0.5B; a 1.5B engine, its base copy and the rebuilt tensors do not fit here beside
the trainer's), one real `rl inference` server (CPU engine, bfloat16, weight_sync.delta):
  delta apply     POST /update_weights on the delta: the worker rebuilds the version from the base
                  it holds, checks the checksum, reloads in place (reload_s: the pause, engine idle)
  full apply      POST /update_weights on the full directory (no digest: the pre-delta path)
  vLLM reload     vLLM's own reload_weights(weights_path=full directory) through its dev-mode
                  /collective_rpc (no pause, no tied lm_head fix-up): the floor for a full file
Without --server the apply side is timed offline: the worker's own BaseVersion.read (the base's
files, checked) once, then per version the rebuild + checksum (inference/delta_rebuild.py rebuilt), the
part of a delta apply before vLLM's load.
Results: benchmarks/results/weight_delta_update.json; docs/performance.md "Weight deltas".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "benchmarks" / "results" / "weight_delta_update.json"
TINY = ROOT / "models" / "tiny-reverse"

from weight_delta import SHAPES, init_tensor, meta_parameters  # noqa: E402

from rl.weights import delta as wd  # noqa: E402
from rl.config import RunConfig  # noqa: E402
from rl.rundir import RunDir  # noqa: E402


def version(params, step: int, lr: float) -> dict[str, torch.Tensor]:
    """The bf16 tensors after `step` - 1 steps of +-lr from the init (step 1: the init)."""
    out = {}
    for i, (name, shape) in enumerate(params):
        master = init_tensor(name, shape, torch.Generator().manual_seed(1000 + i))
        for s in range(2, step + 1):
            g = torch.Generator().manual_seed(10**6 * s + i)
            master += lr * (torch.randint(0, 2, shape, generator=g, dtype=torch.int8) * 2 - 1)
        out[name] = master.to(torch.bfloat16)
        del master
    return out


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def model_dir(shape: str, tmp: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """An HF directory of the shape holding `tensors` (the server starts on it)."""
    from transformers import Qwen2Config

    keys, layers = SHAPES[shape]
    out = tmp / "model"
    out.mkdir()
    Qwen2Config(**keys, num_hidden_layers=layers, max_window_layers=layers, torch_dtype="bfloat16").save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # vLLM wants one; ids are all we send
        shutil.copy2(TINY / f, out / f)
    save_file(tensors, out / "model.safetensors")
    return out


def start_server(model: Path, run: RunDir, log: Path) -> tuple[subprocess.Popen, str]:
    from conftest import free_port

    port = free_port()
    cfg = run.root.parent / "server.toml"
    cfg.write_text(f'model = "{model}"\noutput_dir = "{run.root}"\nseq_len = 256\n'
                   f'[inference]\nport = {port}\ndtype = "bfloat16"\n[weight_sync]\ndelta = true\n')
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "inference", "@", str(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
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


def cpu_s(root_pid: int) -> float:
    """CPU seconds (user + system) used so far by `root_pid` and every process under it (the
    server, its engine core): on a machine shared with other jobs, wall seconds measure the
    neighbours as much as the update, CPU seconds only the update's own work."""
    parents, times = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        times[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid, t in times.items():
        p = pid
        while p not in (0, 1, root_pid) and p in parents:
            p = parents[p]
        if p == root_pid:
            total += t
    return total


def update(url: str, path: Path, v: int, pid: int) -> dict:
    start, cpu = time.perf_counter(), cpu_s(pid)
    r = httpx.post(f"{url}/update_weights", json={"path": str(path), "version": v, "mode": "wait"}, timeout=1200)
    if r.status_code != 200:
        raise RuntimeError(f"/update_weights {path}: {r.status_code} {r.text[:2000]}")
    return {**r.json(), "wall_s": time.perf_counter() - start, "cpu_s": cpu_s(pid) - cpu}


def vllm_reload(url: str, path: Path, pid: int) -> dict:
    start, cpu = time.perf_counter(), cpu_s(pid)
    r = httpx.post(f"{url}/collective_rpc", timeout=1200, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(path)}, "timeout": 1200})
    if r.status_code != 200:
        raise RuntimeError(f"/collective_rpc: {r.status_code} {r.text[:2000]}")
    return {"wall_s": time.perf_counter() - start, "cpu_s": cpu_s(pid) - cpu}


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn()."""
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def measure(args) -> dict:
    from inference.delta_rebuild import BaseVersion, rebuilt
    from trainer.publish import FilePublisher
    from trainer.weights import write_weights

    params = meta_parameters(args.shape)
    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as d:
        tmp = Path(d)
        run, fulls = RunDir(tmp / "run"), RunDir(tmp / "run" / "weights" / "full")
        run.make()
        cfg = RunConfig.model_validate({"model": str(TINY), "output_dir": str(run.root),
                                        "inference": {"dtype": "bfloat16"},
                                        "weight_sync": {"delta": True, "full_every": args.steps + 1},
                                        "trainer": {"files": {"keep_weights": 100}}})
        publisher, policy = FilePublisher(0, None, cfg, run, tied=True), SimpleNamespace(cfg=cfg, run=run)
        server = url = None
        base = None
        try:
            for v in range(1, args.steps + 2):
                t0 = time.perf_counter()
                tensors = version(params, v, args.lr)
                gen_s = time.perf_counter() - t0
                row = {"version": v, "k": v - 1, "make_s": gen_s}
                if v == 1 and args.server:
                    server, url = start_server(model_dir(args.shape, tmp, tensors), run, tmp / "server.log")
                row["publish_s"], row["publish_cpu_s"] = timed(lambda: publisher.deliver(policy, v, tensors))
                row["bytes"] = size(run.weights_dir(v))
                if v > 1:
                    row["changed"] = wd.read_manifest(run.weights_dir(v)).changed
                    # As with weight_sync.delta = false: no digest, vLLM's own reload on the server.
                    row["full_publish_s"], row["full_publish_cpu_s"] = timed(
                        lambda: write_weights(fulls, v, tensors, TINY, True))
                    row["full_bytes"] = size(fulls.weights_dir(v))
                tensors = None  # before the apply: the 1.5B shape needs the memory
                if url is not None:
                    row["apply"] = update(url, run.weights_dir(v), v, server.pid)
                    if v > 1:
                        row["full_apply"] = update(url, fulls.weights_dir(v), v, server.pid)
                        row["vllm_reload"] = vllm_reload(url, fulls.weights_dir(v), server.pid)
                elif v == 1:
                    start, cpu = time.perf_counter(), time.process_time()
                    base = BaseVersion.read(str(run.weights_dir(1)))
                    row["base_read_s"], row["base_read_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
                else:
                    from safetensors.torch import load_file

                    start, cpu = time.perf_counter(), time.process_time()
                    manifest = wd.read_manifest(run.weights_dir(v))
                    with rebuilt(base, manifest, load_file(run.weights_dir(v) / wd.TENSORS)):
                        row["rebuild_s"], row["rebuild_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
                if v > 1:
                    shutil.rmtree(fulls.weights_dir(v))
                print(json.dumps({k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items()}),
                      flush=True)
                rows.append(row)
        finally:
            if server is not None:
                os.killpg(server.pid, signal.SIGTERM)
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                keep = ROOT / "runs" / "bench"
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tmp / "server.log", keep / f"weight_delta_update_{args.shape}_server.log")
    return {"shape": args.shape, "lr": args.lr, "steps": args.steps, "server": args.server,
            "params": sum(int(torch.Size(s).numel()) for _, s in params), "rows": rows,
            "torch_threads": torch.get_num_threads()}


def table(results: dict) -> str:
    """One row per delta version; seconds as CPU seconds (wall seconds in brackets)."""
    lines = ["| shape | k | values changed | bytes: delta / full (share) | publish s: delta / full "
             "| apply s: delta / full | vLLM reload s | publish + apply: delta / full |", "|" + "---|" * 8]
    for key in sorted(results):
        r = results[key]
        for row in r["rows"][1:]:
            frac = row["bytes"] / row["full_bytes"]
            pub = (f"{row['publish_cpu_s']:.2f} / {row['full_publish_cpu_s']:.2f} "
                   f"({row['publish_s']:.1f} / {row['full_publish_s']:.1f})")
            if "apply" in row:
                a, f, vl = row["apply"], row["full_apply"], row["vllm_reload"]
                apply = f"{a['cpu_s']:.2f} / {f['cpu_s']:.2f} ({a['reload_s']:.1f} / {f['reload_s']:.1f})"
                vllm = f"{vl['cpu_s']:.2f} ({vl['wall_s']:.1f})"
                ratio = f"{(row['publish_cpu_s'] + a['cpu_s']) / (row['full_publish_cpu_s'] + f['cpu_s']):.2f}x"
            else:
                apply, vllm, ratio = f"rebuild {row['rebuild_cpu_s']:.2f} ({row['rebuild_s']:.1f}) / -", "-", "-"
            lines.append(f"| {r['shape']} | {row['k']} | {100 * row['changed'] / r['params']:.2f}% | "
                         f"{row['bytes'] / 2**20:.0f} / {row['full_bytes'] / 2**20:.0f} MB ({100 * frac:.1f}%) | "
                         f"{pub} | {apply} | {vllm} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["run", "table"], default="run")
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--server", action="store_true")
    args = ap.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.mode == "run":
        r = measure(args)
        key = f"{args.shape}_{'server' if args.server else 'offline'}_{args.lr:g}"
        if args.shape == "tiny":  # for trying the script out: not saved
            results = {key: r}
        else:
            results[key] = r
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
