"""A vision-language model at real size on CPU (issue 62): SmolVLM-Instruct's shape (Idefics3,
2.25B parameters, random weights: scripts/make_vlm_model.py --shape smolvlm-2b), one trainer step
on image chats and one weight reload in the real vLLM server, each measured as a user starts it.

    python scripts/make_vlm_model.py --shape smolvlm-2b --out models/smolvlm-shape-2b   # once, ~2 min
    python benchmarks/vlm_real_size.py                   # ~10-15 min on 2 cores
    python benchmarks/vlm_real_size.py --part serve      # the server half only

train: `rl sft` for one step of --batch image chats (tasks/shapes.py pictures, which the
  processor resizes to 384x384: 81 image tokens each), LoRA rank 16: full tuning's AdamW state
  alone would be 2.25B x 12 bytes = 27 GB, over this machine's 24 GiB. The vision tower's own
  weights stay frozen (trainer.vision.train_tower's default); trainer.lora's default target
  names (q/k/v_proj among them) also match its attention, so it gets adapters too (counted). Measured: wall time of the
  command, the step's seconds and the adapter's write (metrics.jsonl), peak memory (PSS of the
  process tree, every 0.25 s).
serve: `rl inference` on the model (--dtype, bfloat16 by default), seconds until /health answers;
  one greedy /generate with a picture (its expanded prompt checked against the orchestrator's);
  /update_weights with a full copy of the weights as version 1 (hard links into
  output_dir/weights/step_1: the files the trainer's full-tuning publish writes), the reload's
  seconds; the same /generate again (the engine serves the reloaded model); peak PSS of the
  server's processes.

Results: benchmarks/results/vlm_real_size.json; docs/performance.md "A VLM at real size" reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from process_tree import children_of, process_stat, process_tree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RL = [sys.executable, "-m", "asyncrl"]
OUT = ROOT / "runs" / "vlm_real_size"


class Peak(threading.Thread):
    """Peak PSS (bytes) of a process and everything under it, sampled every 0.25 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            stats = [process_stat(p) for p in process_tree(self.pid, children_of())]
            self.peak = max(self.peak, sum(s[0] for s in stats if s))
            self.stop.wait(0.25)


def gib(n: float) -> float:
    return round(n / 2**30, 2)


def train(model: Path, batch: int, env: dict) -> dict:
    out = OUT / "train"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cfg = out.parent / "train.toml"
    cfg.write_text(f'model = "{model}"\noutput_dir = "{out}"\nmax_steps = 1\nseq_len = 256\nseed = 0\n'
                   "[trainer]\ntorch_threads = 1\n[trainer.lora]\nrank = 16\n"
                   f"[sft]\nbatch_size = {batch}\n[[sft.datasets]]\nfunction = \"tasks.shapes:sft_rows\"\nsize = {batch}\n")
    start = time.perf_counter()
    proc = subprocess.Popen([*RL, "sft", "@", str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peak = Peak(proc.pid)
    peak.start()
    log = proc.communicate()[0]
    wall = time.perf_counter() - start
    peak.stop.set()
    (OUT / "train.log").write_text(log)
    if proc.returncode != 0:
        raise SystemExit(f"rl sft failed ({proc.returncode}): {OUT / 'train.log'}\n{log[-2000:]}")
    record = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                  if r.get("program") == "trainer")
    return {"wall_s": round(wall, 1), "step_s": round(record["step_s"], 1), "write_s": round(record["write_s"], 2),
            "tokens": record["tokens"], "loss_tokens": record["loss_tokens"], "images": batch,
            "peak_pss_gib": gib(peak.peak), "lora_tensors": adapter_tensors(out / "weights" / "step_1"),
            "tuning": "LoRA rank 16 (trainer.lora's default targets), vision tower frozen"}


def adapter_tensors(path: Path) -> dict:
    """How many of the adapter's tensors sit on the language model and on the vision tower."""
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    return {"text": sum(".text_model." in k for k in keys), "vision": sum(".vision_model." in k for k in keys)}


def post(url: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def image_request(model: Path) -> tuple[dict, list[int]]:
    """A greedy /generate of one shapes picture, and the expanded prompt the trainer would see."""
    from orchestrator.rendering.chat import ChatTemplate
    from orchestrator.rendering.images import image_support, render_image_prompt, request_fields
    from orchestrator.rendering.tokenizer import load_tokenizer
    from tasks import shapes

    row = next(shapes.heldout(0))
    prompt = render_image_prompt(ChatTemplate.load(model), image_support(model), load_tokenizer(str(model)),
                                 row["messages"], [])
    return ({"request_id": "vlm-real-size", **request_fields(prompt), "max_tokens": 2, "temperature": 0.0},
            prompt.token_ids)


def serve(model: Path, dtype: str, port: int, env: dict) -> dict:
    out = OUT / "serve"
    shutil.rmtree(out, ignore_errors=True)
    (out / "weights" / "step_1").mkdir(parents=True)
    for f in model.iterdir():  # version 1: the same files, as a full-tuning publish writes them
        os.link(f, out / "weights" / "step_1" / f.name)
    cfg = out.parent / "serve.toml"
    cfg.write_text(f'model = "{model}"\noutput_dir = "{out}"\nseq_len = 256\n[inference]\nport = {port}\n'
                   f'dtype = "{dtype}"\n[inference.timeouts]\nreload_s = 1800\n')
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    logf = open(OUT / "serve.log", "w")
    proc = subprocess.Popen([*RL, "inference", "@", str(cfg)], env=env, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    peak = Peak(proc.pid)
    peak.start()
    try:
        while not healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"rl inference exited ({proc.returncode}): {OUT / 'serve.log'}")
            if time.perf_counter() - start > 1800:
                raise SystemExit("rl inference not ready after 30 min")
            time.sleep(1)
        ready = time.perf_counter() - start
        ready_pss = peak.peak
        body, expanded = image_request(model)
        t = time.perf_counter()
        first = post(url + "/generate", body)
        generate_s = time.perf_counter() - t
        engine_ids = first.get("prompt_token_ids")
        t = time.perf_counter()
        reload = post(url + "/update_weights", {"path": "weights/step_1", "version": 1})
        reload_wall = time.perf_counter() - t
        again = post(url + "/generate", body)
        return {"dtype": dtype, "ready_s": round(ready, 1), "generate_s": round(generate_s, 1),
                "prompt_tokens": len(expanded), "expanded_as_orchestrator": engine_ids == expanded,
                "reload_s": round(reload["reload_s"], 1), "reload_wall_s": round(reload_wall, 1),
                "version_after": reload["version"],
                # The same weights reloaded: the same greedy tokens, now tagged with version 1.
                "same_greedy_after_reload": [s["token_ids"] for s in again["samples"]] ==
                [s["token_ids"] for s in first["samples"]],
                "versions_after_reload": sorted({v for s in again["samples"] for v in s["versions"]}),
                "peak_pss_ready_gib": gib(ready_pss), "peak_pss_gib": gib(peak.peak)}
    finally:
        peak.stop.set()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        logf.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smolvlm-shape-2b")
    ap.add_argument("--part", choices=["train", "serve", "both"], default="both")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=8399)
    args = ap.parse_args()
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model}: build it first: python scripts/make_vlm_model.py --shape smolvlm-2b --out {model}")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    results_path = ROOT / "benchmarks" / "results" / "vlm_real_size.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    import math

    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:  # the header only: no weights loaded
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    results.update(date=time.strftime("%Y-%m-%d"), model=str(model.relative_to(ROOT)) if model.is_relative_to(ROOT)
                   else str(model), parameters=params, text_layers=config.text_config.num_hidden_layers,
                   vision_layers=config.vision_config.num_hidden_layers, cores=os.cpu_count(),
                   load_average=os.getloadavg()[0])
    OUT.mkdir(parents=True, exist_ok=True)
    if args.part in ("train", "both"):
        results["train"] = train(model, args.batch, env)
        print("train:", results["train"], flush=True)
    if args.part in ("serve", "both"):
        results["serve"] = serve(model, args.dtype, args.port, env)
        print("serve:", results["serve"], flush=True)
    results_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written: {results_path}")


if __name__ == "__main__":
    main()
