"""Context parallelism's memory per rank at Qwen2.5-0.5B's shape: one sample of 16k and 32k tokens
at CP = 1, 2, 4, and the longest sample a per-rank memory budget holds.

    .venv/bin/python benchmarks/trainer_parallel.py memory [--tokens 16384 32768] [--context 1 2 4] [--layers 24]
    .venv/bin/python benchmarks/trainer_parallel.py longest [--budget-gib 80] [--context 1 2 4] [--verify]
    .venv/bin/python benchmarks/trainer_parallel.py check [--tokens 2048] [--layers 1]

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
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# Qwen2.5-0.5B (494M parameters, tied embeddings).
SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
             max_position_embeddings=131072)
PROMPT = 512  # a prompt's tokens, then a completion trained on


def one_sample(tokens: int, prompt: int):
    """A prompt, then a completion trained on (advantage 1, on-policy logprobs of -1)."""
    import numpy as np

    from rl.batch import Sample

    ids = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], tokens).tolist()
    c = tokens - prompt
    return Sample(ids, [0] * prompt + [1] * c, [0.0] * prompt + [-1.0] * c, [0.0] * prompt + [1.0] * c,
                  [-1] * prompt + [0] * c, 1.0, 1.0, 1.0, -1, 0.0)


def one_rank(tokens: int, context: int, index: int, layers: int, fake: bool, checkpointing: bool) -> dict:
    """Peak bytes by kind of one rank's forward and backward on one sample of `tokens`."""
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

    torch.set_num_threads(1)
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=index, world_size=context)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    attention = context_parallel.NAME if context > 1 else packed_attention.NAME
    (context_parallel if context > 1 else packed_attention).register()
    share = ContextShare(dist.group.WORLD if context > 1 else None, context, index)
    config = Qwen2Config(**{**SHAPE, "num_hidden_layers": layers}, attn_implementation=attention)
    batch = Batch.from_samples(1, [one_sample(tokens, PROMPT)])
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
    with tracker:
        logprobs, entropy = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=False, context=share)
        loss = policy_loss(logprobs, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.loss_weight,
                           mb.sequence_ids, LossConfig(), entropy=entropy).loss
        loss.backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    out = {k: int(v) for k, v in peak.items()}
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
               str(int(fake)), str(int(checkpointing))]
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


def _rank_main(argv: list[str]) -> None:
    tokens, context, index, layers, fake, checkpointing = map(int, argv)
    rss = None
    if not fake:  # the resident peak, measured around the same step
        Path("/proc/self/clear_refs").write_text("5")
        rss = _status("VmRSS")
    out = one_rank(tokens, context, index, layers, bool(fake), bool(checkpointing))
    if rss is not None:
        out["rss_growth"] = _status("VmHWM") - rss
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
    parser.add_argument("mode", choices=["memory", "longest", "check"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--context", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--verify", action="store_true", help="longest: measure the answer once more")
    args = parser.parse_args()
    rows = {"memory": cmd_memory, "longest": cmd_longest, "check": cmd_check}[args.mode](args)
    out = ROOT / "benchmarks" / "results" / f"trainer_parallel_{args.mode}{'_ckpt' if args.checkpointing else ''}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
