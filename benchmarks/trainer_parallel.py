"""Context parallelism's memory per rank at Qwen2.5-0.5B's shape: one sample of 16k and 32k tokens
at CP = 1, 2, 4, and the longest sample a per-rank memory budget holds.

    .venv/bin/python benchmarks/trainer_parallel.py memory [--tokens 16384 32768] [--context 1 2 4] [--layers 24]
    .venv/bin/python benchmarks/trainer_parallel.py longest [--budget-gib 80] [--context 1 2 4] [--verify]
    .venv/bin/python benchmarks/trainer_parallel.py check [--tokens 2048] [--layers 1]
    .venv/bin/python benchmarks/trainer_parallel.py real [--tokens 8192 32768] [--context 1 2 4] [--layers 2]
        [--vocab 8192] [--hidden 256 --intermediate 1408 --heads 4 --kv-heads 2]
    .venv/bin/python benchmarks/trainer_parallel.py budget --budget-gib 1.0 [--context 1 2 4] [the same shape]

A forward and backward pass at 32k tokens is ~10^13 floating-point operations per layer; on this
project's loaded 2-core CPU that is hours per point. So `memory` and `longest` run the trainer's
real code (the random-weight model built in-process, trainer/model.py micro_batch_logprobs with
its LogprobHead, trainer/context_parallel.py's attention and gathers, trainer/loss.py) on fake
tensors (torch's FakeTensorMode: shapes, dtypes and allocations, no arithmetic) under a fake
process group as one rank of the context group, and count every tensor's bytes while it lives
(torch.distributed._tools.mem_tracker.MemTracker: what a GPU's caching allocator would be asked
for, without its fragmentation). The group's last rank is measured (its queries meet the whole
row: the largest attention blocks; the rest of its memory is every rank's). `check` runs the same count on real tensors at a small length and compares it with the
process's own peak resident memory (VmHWM after clear_refs), to show the count is the memory.

`real` runs the same step for real: C processes on this machine form a real gloo group, real
float32 tensors, one forward and backward of one sample, at a shape small enough to run at 32k
tokens here (the arithmetic, not the memory, is what forbids the full shape). Per rank it reads
two figures: the tensors' peak (the same MemTracker count on real tensors: the bytes of live
tensors, which is what a GPU rank's torch.cuda.max_memory_allocated counts, since device memory
holds tensors only) and the process's resident high-water mark over the step (VmHWM after
clear_refs: the host's truth, which adds what is not a tensor: the CPU kernels' own scratch,
gloo's buffers, and what glibc keeps after a free). `budget` then puts each rank in a memory
cgroup of its own with the limit as its per-rank budget and finds, by running, the longest
sample that completes under it.

Per rank, "activation" is the peak's total minus parameters, buffers and gradients (those are
allocated before the step, as after a first step). CP = 1 runs trainer.model.attention = "varlen"
(trainer/packed_attention.py: no [T, T] mask), CP > 1 the context attention. float32 weights and
activations (the trainer's CPU dtype; a bfloat16 GPU run halves the activations). Results go to
benchmarks/results/trainer_parallel_<mode>.json; docs/trainer.md ("Parallelism") has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# Qwen2.5-0.5B (494M parameters, tied embeddings).
SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
             max_position_embeddings=131072)
PROMPT = 512  # a prompt's tokens, then a completion trained on


def one_sample(tokens: int, prompt: int, vocab: int = SHAPE["vocab_size"]):
    """A prompt, then a completion trained on (advantage 1, on-policy logprobs of -1)."""
    import numpy as np

    from rl.batch import Sample

    ids = np.random.default_rng(0).integers(3, vocab, tokens).tolist()
    c = tokens - prompt
    return Sample(ids, [0] * prompt + [1] * c, [0.0] * prompt + [-1.0] * c, [0.0] * prompt + [1.0] * c,
                  [-1] * prompt + [0] * c, 1.0, 1.0, 1.0, -1, 0.0)


def one_rank(tokens: int, context: int, index: int, layers: int, fake: bool, checkpointing: bool,
             vocab: int = SHAPE["vocab_size"], threads: int = 1, shape: dict | None = None) -> dict:
    """Peak bytes by kind of one rank's forward and backward on one sample of `tokens`. Real
    tensors (`fake` false) with context > 1: one rank of a real gloo group (torchrun's
    environment variables, `real` mode); there the process's resident memory is read too."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rl.batch import Batch
    from rl.config import LossConfig
    from trainer import context_parallel, packed_attention
    from trainer.context_parallel import ContextShare
    from trainer.data import loss_weights, rank_micro_batches
    from trainer.logprob_head import LogprobHead
    from trainer.loss import policy_loss
    from trainer.model import micro_batch_logprobs

    torch.set_num_threads(threads)
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=index, world_size=context)
    elif context > 1:
        dist.init_process_group("gloo")  # MASTER_ADDR/PORT, RANK, WORLD_SIZE from real_group
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    attention = context_parallel.NAME if context > 1 else packed_attention.NAME
    (context_parallel if context > 1 else packed_attention).register()
    share = ContextShare(dist.group.WORLD if context > 1 else None, context, index)
    config = Qwen2Config(**{**SHAPE, **(shape or {}), "num_hidden_layers": layers, "vocab_size": vocab},
                         attn_implementation=attention)
    batch = Batch.from_samples(1, [one_sample(tokens, PROMPT, vocab)])
    (mb,) = rank_micro_batches(batch, 0, 1, row_len=tokens, per_micro_batch=1, pad_id=0,
                               weights=loss_weights(batch, "token", tokens))
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.enable_grad()
    with mode:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # trainer/logprob_head.py install without its probe (a forward, which a fake tensor's
        # data-dependent shapes cannot run): Qwen2 passes it.
        model.set_output_embeddings(LogprobHead(model.get_output_embeddings(), 1024))
        for p in model.parameters():  # allocated before the step (as after a first one)
            p.grad = torch.zeros_like(p)
    # The step outside the mode: the host's own small tensors (the micro-batch, document
    # boundaries, the head's positions) stay real; every op on the model's fake tensors is fake.
    tracker = MemTracker()
    tracker.track_external(model)
    if not fake:  # the resident high-water mark from here on (the model and its gradients exist)
        Path("/proc/self/clear_refs").write_text("5")
        rss_step = _status("VmRSS")
    start = time.perf_counter()
    with tracker:
        logprobs, entropy = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=False, context=share)
        loss = policy_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.loss_weight,
                           mb.sequence_ids, LossConfig(), entropy=entropy).loss
        loss.backward()
    step_s = time.perf_counter() - start
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    out = {k: int(v) for k, v in peak.items()}
    if not fake:
        out.update(rss_step_start=rss_step, rss_hwm=_status("VmHWM"), step_s=step_s)
    out["activation"] = out["Total"] - out.get("Parameter", 0) - out.get("Buffer", 0) - out.get("Gradient", 0)
    dist.destroy_process_group()
    return out


def measure(tokens: int, context: int, layers: int, checkpointing: bool = False, fake: bool = True,
            every_rank: bool = False) -> dict:
    """The largest per-rank peak over the context group's rank indices (each in a fresh process);
    without `every_rank`, the last rank's only: its queries meet the whole row, its attention
    blocks are the largest, the rest of its memory is every rank's."""
    per_rank = []
    for index in range(context) if every_rank else [context - 1]:
        cmd = [sys.executable, __file__, "_rank", str(tokens), str(context), str(index), str(layers),
               str(int(fake)), str(int(checkpointing)), str(SHAPE["vocab_size"]), "1"]
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=3600,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        if got.returncode != 0:
            raise RuntimeError(got.stderr[-3000:])
        per_rank.append(json.loads(got.stdout.strip().splitlines()[-1]))
    worst = max(per_rank, key=lambda r: r["activation"])
    return {"tokens": tokens, "context": context, "layers": layers, "checkpointing": checkpointing,
            "activation_bytes": worst["activation"], "total_bytes": worst["Total"],
            "per_rank_activation_bytes": [r["activation"] for r in per_rank], "peak": worst}


def static_bytes(context: int, data: int = 1) -> int:
    """Parameters, gradients and AdamW's two moments (float32, FSDP2-sharded over every rank of a
    data x context world): what a rank holds besides activations, at the full 24 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**SHAPE)).parameters())
    return 16 * n // (context * data)


def cmd_memory(args) -> list[dict]:
    rows = []
    for tokens in args.tokens:
        for context in args.context:
            row = measure(tokens, context, args.layers, args.checkpointing)
            one = next((r for r in rows if r["tokens"] == tokens and r["context"] == 1), None)
            row["vs_cp1"] = row["activation_bytes"] / one["activation_bytes"] if one else None
            rows.append(row)
            print(f"{tokens:6d} tokens CP={context}: activation {row['activation_bytes'] / 2**30:7.2f} GiB per rank"
                  f" ({args.layers} layers)" + (f", {row['vs_cp1']:.2f}x CP=1" if row["vs_cp1"] else ""), flush=True)
    return rows


def cmd_longest(args) -> list[dict]:
    """The longest sample whose activations plus the rank's static share (static_bytes) fit the
    budget: activation memory is linear in the tokens (no [T, T] tensor anywhere: flash
    attention, the chunked head), so `memory`'s two lengths per CP give it as a + b * tokens,
    scaled to 24 layers if measured at fewer (each layer keeps the same); the answer is then
    measured once more to check it fits."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "trainer_parallel_memory.json").read_text())["rows"]
    budget = int(args.budget_gib * 2**30)
    rows = []
    for context in args.context:
        (t0, m0), (t1, m1) = sorted((r["tokens"], r["activation_bytes"] * SHAPE["num_hidden_layers"] / r["layers"])
                                    for r in measured if r["context"] == context)[:2]
        slope = (m1 - m0) / (t1 - t0)
        room = budget - static_bytes(context)
        longest = int((room - (m0 - slope * t0)) / slope) // 1024 * 1024
        check = measure(longest, context, SHAPE["num_hidden_layers"])["activation_bytes"] if args.verify else None
        rows.append({"context": context, "budget_gib": args.budget_gib, "longest_tokens": longest,
                     "static_bytes": static_bytes(context), "bytes_per_token": slope,
                     "verified_activation_bytes": check, "fits": None if check is None else check <= room})
        print(f"CP={context}: longest sample within {args.budget_gib} GiB per rank: {longest} tokens "
              f"({slope / 2**10:.0f} KiB of activations per token)" +
              ("" if check is None else f"; measured there: {(check + static_bytes(context)) / 2**30:.1f} GiB"),
              flush=True)
    return rows


def cmd_check(args) -> list[dict]:
    """The count against the process's own peak resident memory, real tensors, small length."""
    rows = []
    for context in (1,):
        counted = measure(args.tokens[0], context, args.layers, fake=False)
        rows.append(counted)
        print(f"{args.tokens[0]} tokens, {args.layers} layer(s), real tensors: counted activation "
              f"{counted['activation_bytes'] / 2**20:.0f} MiB; resident growth "
              f"{counted['peak']['rss_growth'] / 2**20:.0f} MiB",
              flush=True)
    return rows


# --- real tensors, real ranks (`real`, `budget`) ------------------------------------------------

CGROUP = Path("/sys/fs/cgroup/memory")  # cgroup v1, writable as root here (GUIDE.md)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enter_cgroup(path: Path):
    """preexec_fn: the rank joins its own memory cgroup before exec, so every page it touches is
    charged there (v1 charges pages to the group of the task that first touches them)."""
    def enter():
        (path / "cgroup.procs").write_text(str(os.getpid()))
    return enter


def real_group(tokens: int, context: int, layers: int, vocab: int, limit: int | None = None,
               shape: dict | None = None) -> dict:
    """One forward and backward of one `tokens` sample on `context` real gloo ranks (processes on
    this machine), real float32 tensors. Per rank: the tensor count's peak (MemTracker) and the
    resident high-water mark. `limit`: bytes per rank, each rank in a memory cgroup of its own
    with that limit (the kernel's OOM killer ends a rank that exceeds it)."""
    port, threads = _free_port(), max(1, (os.cpu_count() or 1) // context)
    procs, groups = [], []
    for index in range(context):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(index), "WORLD_SIZE": str(context), "LOCAL_RANK": str(index),
               "OMP_NUM_THREADS": str(threads)}
        pre = None
        if limit is not None:
            group = CGROUP / f"asyncrl_bench_{os.getpid()}_{index}"
            group.mkdir(exist_ok=True)
            (group / "memory.limit_in_bytes").write_text(str(limit))
            (group / "memory.memsw.limit_in_bytes").exists() and (group / "memory.memsw.limit_in_bytes").write_text(str(limit))
            groups.append(group)
            pre = _enter_cgroup(group)
        cmd = [sys.executable, __file__, "_rank", str(tokens), str(context), str(index), str(layers), "0", "0",
               str(vocab), str(threads), json.dumps(shape or {})]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      preexec_fn=pre))
    ranks, failed = [], []
    start = time.perf_counter()
    for index, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=7200)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if proc.returncode == 0:
            ranks.append(json.loads(out.strip().splitlines()[-1]))
        else:
            failed.append({"rank": index, "returncode": proc.returncode, "stderr": err[-600:]})
        if failed:  # a killed rank leaves the others waiting in a collective
            for q in procs:
                q.kill()
    wall = time.perf_counter() - start
    charged = []
    for group in groups:
        charged.append(int((group / "memory.max_usage_in_bytes").read_text()))
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    row = {"tokens": tokens, "context": context, "layers": layers, "vocab": vocab, "shape": shape, "limit_bytes": limit,
           "completed": not failed, "failed": failed, "wall_s": wall, "cgroup_max_usage_bytes": charged}
    if ranks:
        row.update(
            tracked_peak_bytes=max(r["Total"] for r in ranks), tracked_activation_bytes=max(r["activation"] for r in ranks),
            rss_hwm_bytes=max(r["rss_hwm"] for r in ranks), rss_step_growth_bytes=max(r["rss_hwm"] - r["rss_step_start"] for r in ranks),
            static_bytes=max(r.get("Parameter", 0) + r.get("Gradient", 0) for r in ranks),
            step_s=max(r["step_s"] for r in ranks), per_rank=ranks)
    return row


def cmd_real(args) -> list[dict]:
    rows = []
    for tokens in args.tokens:
        for context in args.context:
            row = real_group(tokens, context, args.layers, args.vocab, shape=_shape(args))
            one = next((r for r in rows if r["tokens"] == tokens and r["context"] == 1), None)
            if one:
                row["vs_cp1_tracked"] = row["tracked_activation_bytes"] / one["tracked_activation_bytes"]
                row["vs_cp1_rss"] = row["rss_step_growth_bytes"] / one["rss_step_growth_bytes"]
            rows.append(row)
            print(f"{tokens:6d} tokens CP={context} ({args.layers} layer(s), vocab {args.vocab}): per rank "
                  f"tensors' activation peak {row['tracked_activation_bytes'] / 2**30:.2f} GiB, resident growth in "
                  f"the step {row['rss_step_growth_bytes'] / 2**30:.2f} GiB, resident peak "
                  f"{row['rss_hwm_bytes'] / 2**30:.2f} GiB, step {row['step_s']:.0f} s" +
                  (f"; {row['vs_cp1_tracked']:.2f}x / {row['vs_cp1_rss']:.2f}x CP=1" if one else ""), flush=True)
            _save("real", args, rows)
    return rows


def cmd_budget(args) -> list[dict]:
    """The longest sample a rank holds within `--budget-gib` of memory per rank, at each CP, with
    the budget enforced by the kernel: each rank in a memory cgroup of that limit (v1, charging
    what the rank's pages cost; clean file pages, the libraries', are reclaimed at the limit
    rather than failing the rank). `real`'s two lengths per CP give the rank's resident peak as
    a + b * tokens (linear: no [T, T] tensor); solved for the budget it is a first guess, low by
    the shared libraries' resident pages the cgroup does not hold against the rank. From there
    the length grows by 1.25x while the step completes under the limit, up to --tries runs: the
    answer is the bracket, the longest that completed and the first the kernel killed."""
    measured = json.loads((ROOT / "benchmarks" / "results" / "trainer_parallel_real.json").read_text())["rows"]
    budget = int(args.budget_gib * 2**30)
    rows = []
    for context in args.context:
        (t0, m0), (t1, m1) = sorted((r["tokens"], r["rss_hwm_bytes"]) for r in measured
                                    if r["context"] == context and r["layers"] == args.layers and r["completed"])[:2]
        slope = (m1 - m0) / (t1 - t0)
        tokens = int((0.97 * budget - (m0 - slope * t0)) / slope) // 1024 * 1024
        tokens = args.start * context or tokens  # --start: a first length per context rank of one's own
        runs = []
        for _ in range(args.tries):
            runs.append(real_group(tokens, context, args.layers, args.vocab, limit=budget, shape=_shape(args)))
            print(f"CP={context}, {args.budget_gib} GiB per rank (cgroup limit): {tokens} tokens "
                  f"{'completed' if runs[-1]['completed'] else 'killed'}", flush=True)
            if not runs[-1]["completed"]:
                break
            tokens = int(tokens * 1.25) // 1024 * 1024
        # An earlier invocation's runs at this CP and budget count too (the bracket narrows).
        saved = ROOT / "benchmarks" / "results" / "trainer_parallel_budget.json"
        for row in json.loads(saved.read_text())["rows"] if saved.exists() else []:
            if row["context"] == context and row["budget_gib"] == args.budget_gib:
                runs = row["runs"] + runs
        done = [r["tokens"] for r in runs if r["completed"]]
        killed = [r["tokens"] for r in runs if not r["completed"]]
        rows.append({"context": context, "budget_gib": args.budget_gib,
                     "resident_bytes_per_token": slope, "longest_completed": max(done, default=None),
                     "first_killed": min(killed, default=None), "runs": runs})
        _save("budget", args, rows)
    return rows


def _shape(args) -> dict:
    """`real`'s and `budget`'s model width: Qwen2.5-0.5B's unless given."""
    return {k: v for k, v in (("hidden_size", args.hidden), ("intermediate_size", args.intermediate),
                              ("num_attention_heads", args.heads), ("num_key_value_heads", args.kv_heads)) if v}


def _save(mode: str, args, rows: list[dict]) -> None:
    out = ROOT / "benchmarks" / "results" / f"trainer_parallel_{mode}.json"
    if mode == "budget" and out.exists():  # one CP at a time: the other CPs' rows stay
        kept = [r for r in json.loads(out.read_text())["rows"] if r["context"] not in {r["context"] for r in rows}]
        rows = sorted(kept + rows, key=lambda r: r["context"])
    out.write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "rows": rows}, indent=1) + "\n")


def _rank_main(argv: list[str]) -> None:
    tokens, context, index, layers, fake, checkpointing, vocab, threads = map(int, argv[:8])
    shape = json.loads(argv[8]) if len(argv) > 8 else None
    rss = None
    if not fake:  # the resident peak, measured around the same step
        rss = _status("VmRSS")
    out = one_rank(tokens, context, index, layers, bool(fake), bool(checkpointing), vocab, threads, shape)
    if rss is not None:
        out["rss_start"] = rss
        out["rss_growth"] = out["rss_hwm"] - rss
    print(json.dumps(out))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    if sys.argv[1] == "_rank":
        return _rank_main(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["memory", "longest", "check", "real", "budget"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--context", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="real, budget: the vocabulary")
    for name in ("hidden", "intermediate", "heads", "kv-heads"):
        parser.add_argument(f"--{name}", type=int, default=0, help="real, budget: the model's width (0: Qwen2.5-0.5B's)")
    parser.add_argument("--verify", action="store_true", help="longest: measure the answer once more")
    parser.add_argument("--tries", type=int, default=4, help="budget: runs per CP, growing the length by 1.25x")
    parser.add_argument("--start", type=int, default=0, help="budget: first length per context rank (0: the fit's)")
    args = parser.parse_args()
    rows = {"memory": cmd_memory, "longest": cmd_longest, "check": cmd_check, "real": cmd_real,
            "budget": cmd_budget}[args.mode](args)
    if args.mode in ("real", "budget"):  # saved row by row (_save)
        return
    out = ROOT / "benchmarks" / "results" / f"trainer_parallel_{args.mode}{'_ckpt' if args.checkpointing else ''}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
