"""How much of the served (bfloat16) weights changes per training step, and what a sparse delta
of it weighs against the full file (issue 54, item 1: "measure first").

    .venv/bin/python benchmarks/weight_delta.py trainer --shape 0.5b --steps 8   # the real Trainer
    .venv/bin/python benchmarks/weight_delta.py sim --shape 0.5b --steps 8       # AdamW on random gradients
    .venv/bin/python benchmarks/weight_delta.py sim --shape 1.5b --steps 8
    .venv/bin/python benchmarks/weight_delta.py table                            # markdown from the JSON

Modes (each at lr 1e-6 and 1e-5 unless --lrs says otherwise; both start from the same weights):
  trainer  Qwen2.5-0.5B's shape with random weights (benchmarks/trainer_step.py's model, built into
           a temporary directory), stepped by the project's own Trainer.train_step (FSDP2 on one
           rank, float32 masters, AdamW and clipping from [trainer.optim], the ppo_clip loss) on a
           fresh batch each step (trainer_step.random_batch, seed = step: --samples sequences of
           --min-len..--max-len tokens, random advantages). After each step the weights are
           gathered cast to bfloat16 exactly as the FilePublisher does (gather_full_state_dict).
           A 1.5B shape does not fit: float32 weights + gradients + AdamW's two moments are 16
           bytes a parameter, 24.7 GB at 1.54B, more than this machine's 24 GiB.
  sim      No model in memory: the parameters' names and shapes come from a meta-device model
           of the shape, and one tensor at a time gets transformers' Qwen2 init (N(0, 0.02),
           norms 1, biases 0) as its float32 master, then --steps AdamW steps (the project's
           build_optimizer, one optimizer per tensor) on i.i.d. N(0, 1e-3) gradients, the same
           gradients for every lr. No clipping (AdamW's update does not depend on the gradient's
           scale). Cheap enough for the 1.5B shape.

Per step and per tensor, the bfloat16 tensor is compared bit for bit with the previous step's
("per step") and with step 0's ("after k steps", k in 1, 2, 4, 8, ...: the delta against the last
full version). The tied lm_head is not counted (the file omits it, as the trainer writes it).
Bytes of each encoding, summed over tensors, against the full bf16 file (2 bytes a parameter):
  idx32          int32 flat index + bf16 value per changed value, uncompressed (6 bytes each)
  gaps+zlib      the indices as uint32 gaps from the previous changed index, zlib level 1, plus
                 the values, zlib level 1
  bitmask        one bit per value (changed or not) + the changed values, uncompressed
  bitmask+zlib   the same, each part zlib level 1
  ...+ulps+zlib  gaps or bitmask as above, but each changed value sent as its step in bf16 units
                 (new minus old bit patterns as int16, wrapping: old + step == new bit for bit),
                 zlib level 1: at small lr most steps are +-1 and compress to a few bits
Compression is measured on at most --compress-mb of each stream of each tensor, and the ratio
(and the seconds) extrapolated to the whole stream, to bound the run time at lr 1e-5.
Timed per step, summed over tensors (one thread of torch.get_num_threads() each op uses):
  idx32          encode: bit compare, nonzero, gather the values, indices to int32; apply: int32
                 indices to int64, index_put_ of the values into a copy of the base bf16 tensor
  bitmask+ulps   encode: the above's compare and nonzero, packbits, the int16 steps; zlib of
                 bitmask and steps (extrapolated as above); apply: unpackbits, nonzero,
                 index_put_(accumulate) of the steps into the base's int16 view
Both applied results are checked bit for bit against the new tensor.

Results: benchmarks/results/weight_delta.json (one entry per mode and shape, merged);
docs/performance.md "Weight deltas" reads them.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))
RESULTS = ROOT / "benchmarks" / "results" / "weight_delta.json"

from make_real_size_model import SHAPE as QWEN_05B  # noqa: E402  Qwen2.5-0.5B-Instruct's config
from rl.config import OptimConfig  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402

# Qwen2.5-1.5B's config.json differs from 0.5B's in these (it ties its embeddings too).
QWEN_15B = dict(QWEN_05B, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2)
SHAPES = {"0.5b": (QWEN_05B, 24), "1.5b": (QWEN_15B, 28),
          # for trying the script out in seconds (trainer mode: trainer_step.py's "small"); not saved
          "tiny": (dict(QWEN_05B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=2048), 2)}
TIMES = ["encode_s", "zlib_s", "apply_s", "encode_ulps_s", "zlib_ulps_s", "apply_ulps_s"]
ENCODINGS = ["idx32", "gaps+zlib", "bitmask", "bitmask+zlib", "gaps+ulps+zlib", "bitmask+ulps+zlib"]


# --- one tensor's delta ------------------------------------------------------------------------

def _zlib(data: np.ndarray, cap: int) -> tuple[float, float]:
    """(compressed bytes, seconds) of data's bytes at zlib level 1, measured on at most cap bytes
    and extrapolated."""
    raw = data.view(np.uint8).reshape(-1)
    if raw.size == 0:
        return 0.0, 0.0
    part = raw[:cap]
    start = time.perf_counter()
    out = len(zlib.compress(part.tobytes(), 1))
    seconds = time.perf_counter() - start
    scale = raw.size / part.size
    return out * scale, seconds * scale


def tensor_delta(old: torch.Tensor, new: torch.Tensor, cap: int) -> dict:
    """Bit-level delta of two bf16 tensors of one shape: counts, bytes per encoding, seconds."""
    a, b = old.reshape(-1).view(torch.int16), new.reshape(-1).view(torch.int16)
    # idx32: int32 indices + bf16 values
    start = time.perf_counter()
    changed = a != b
    idx = torch.nonzero(changed).squeeze(1)
    values = b[idx]
    idx32 = idx.to(torch.int32)
    encode_s = time.perf_counter() - start
    n, numel = int(idx.numel()), int(a.numel())
    base = old.clone()
    start = time.perf_counter()
    base.view(-1).index_put_((idx32.long(),), values.view(torch.bfloat16))
    apply_s = time.perf_counter() - start
    assert torch.equal(base.view(-1).view(torch.int16), b), "applied idx32 delta differs from the new tensor"

    # bitmask + steps in bf16 units (int16, wrapping)
    start = time.perf_counter()
    bits = np.packbits(changed.numpy())
    ulps = values - a[idx]
    encode_ulps_s = time.perf_counter() - start + encode_s
    base = old.clone()
    start = time.perf_counter()
    where = torch.from_numpy(np.unpackbits(bits, count=numel).view(np.bool_))
    flat = base.view(-1).view(torch.int16)
    flat.index_put_((torch.nonzero(where).squeeze(1),), ulps, accumulate=True)
    apply_ulps_s = time.perf_counter() - start
    assert torch.equal(flat, b), "applied bitmask+ulps delta differs from the new tensor"

    gaps = torch.diff(idx32, prepend=torch.zeros(1, dtype=torch.int32)).numpy().view(np.uint32)
    gz, gz_s = _zlib(gaps, cap)
    vz, vz_s = _zlib(values.numpy(), cap)
    bz, bz_s = _zlib(bits, cap)
    uz, uz_s = _zlib(ulps.numpy(), cap)
    return {"numel": numel, "changed": n, "one_ulp": int((ulps.abs() == 1).sum()), "full": 2 * numel,
            "idx32": 6 * n, "gaps+zlib": gz + vz, "bitmask": bits.size + 2 * n, "bitmask+zlib": bz + vz,
            "gaps+ulps+zlib": gz + uz, "bitmask+ulps+zlib": bz + uz,
            "encode_s": encode_s, "zlib_s": gz_s + vz_s, "apply_s": apply_s,
            "encode_ulps_s": encode_ulps_s, "zlib_ulps_s": bz_s + uz_s, "apply_ulps_s": apply_ulps_s}


def kind_of(name: str) -> str:
    if "embed_tokens" in name or "lm_head" in name:
        return "embedding"
    if "norm" in name:
        return "norm"
    if name.endswith(".bias"):
        return "bias"
    return "attention" if "self_attn" in name else "mlp"


class Tally:
    """Sums tensor_delta over a model's tensors, overall and per kind of tensor."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.kinds: dict[str, dict[str, int]] = {}

    def add(self, name: str, d: dict) -> None:
        for k, v in d.items():
            self.total[k] = self.total.get(k, 0) + v
        kind = self.kinds.setdefault(kind_of(name), {"numel": 0, "changed": 0})
        kind["numel"] += d["numel"]
        kind["changed"] += d["changed"]

    def result(self) -> dict:
        t = dict(self.total)
        out = {"changed_frac": t["changed"] / t["numel"], **{k: t[k] for k in ("numel", "changed", "full")},
               "one_ulp_frac_of_changed": t["one_ulp"] / max(t["changed"], 1),
               "bytes": {e: t[e] for e in ENCODINGS}, "frac_of_full": {e: t[e] / t["full"] for e in ENCODINGS},
               **{k: t[k] for k in TIMES},
               "kinds": {k: {**v, "changed_frac": v["changed"] / max(v["numel"], 1)} for k, v in self.kinds.items()}}
        return out


def checkpoints(steps: int) -> list[int]:
    ks, k = [], 1
    while k <= steps:
        ks.append(k)
        k *= 2
    return ks


# --- sim: AdamW on random gradients, one tensor at a time -----------------------------------------

def meta_parameters(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import AutoModelForCausalLM, Qwen2Config

    keys, layers = SHAPES[shape]
    cfg = Qwen2Config(**keys, num_hidden_layers=layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # tied lm_head: listed once


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """transformers' Qwen2 init: RMSNorm weights 1, biases 0, other weights N(0, 0.02)."""
    if "norm" in name:
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def sim(args) -> dict:
    params = meta_parameters(args.shape)
    ks = checkpoints(args.steps)
    per_step = {lr: [Tally() for _ in range(args.steps)] for lr in args.lrs}
    after = {lr: {k: Tally() for k in ks} for lr in args.lrs}
    cap = args.compress_mb << 20
    start = time.perf_counter()
    for i, (name, shape) in enumerate(params):
        gen = torch.Generator().manual_seed(1000 + i)
        init = init_tensor(name, shape, gen)
        masters, opts = {}, {}
        for lr in args.lrs:
            p = torch.nn.Parameter(init.clone())
            masters[lr] = p
            opts[lr] = build_optimizer([p], OptimConfig(lr=lr), args.steps)[0]
        base = init.to(torch.bfloat16)
        prev = {lr: base for lr in args.lrs}
        for step in range(1, args.steps + 1):
            grad = torch.empty(shape).normal_(0.0, 1e-3, generator=gen)
            for lr in args.lrs:
                masters[lr].grad = grad
                opts[lr].step()
                cur = masters[lr].detach().to(torch.bfloat16)
                d = tensor_delta(prev[lr], cur, cap)
                per_step[lr][step - 1].add(name, d)
                if step in ks:
                    after[lr][step].add(name, d if step == 1 else tensor_delta(base, cur, cap))
                prev[lr] = cur
        del masters, opts, prev, base, init
        if i % 40 == 0:
            print(f"  tensor {i + 1}/{len(params)} {name} ({time.perf_counter() - start:.0f}s)", flush=True)
    numel = sum(int(np.prod(s)) for _, s in params)
    return {"mode": "sim", "shape": args.shape, "params": numel, "steps": args.steps,
            "lrs": {str(lr): {"per_step": [t.result() for t in per_step[lr]],
                              "after_k": {str(k): after[lr][k].result() for k in ks}} for lr in args.lrs},
            "wall_s": time.perf_counter() - start}


# --- trainer: the project's Trainer.train_step -------------------------------------------------------

def model_delta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], cap: int) -> dict:
    tally = Tally()
    for name, tensor in new.items():
        if name == "lm_head.weight" or not tensor.is_floating_point():
            continue  # tied: the file omits it
        tally.add(name, tensor_delta(old[name], tensor, cap))
    return tally.result()


def trainer_mode(args) -> dict:
    from trainer_step import SHAPES as STEP_SHAPES, build_model, random_batch, trainer
    from trainer.weights import gather_full_state_dict

    if args.shape == "1.5b":
        raise SystemExit("trainer mode: 0.5b only (a 1.5B shape needs 24.7 GB for float32 weights, "
                         "gradients and AdamW state alone; this machine has 24 GiB)")
    ks = checkpoints(args.steps)
    cap = args.compress_mb << 20
    step_shape = "small" if args.shape == "tiny" else "0.5b"
    vocab = STEP_SHAPES[step_shape]["vocab_size"]
    out = {"mode": "trainer", "shape": args.shape, "steps": args.steps, "lrs": {},
           "batch": {"samples": args.samples, "min_len": args.min_len, "max_len": args.max_len}}
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        model = build_model(step_shape, Path(d) / "model")
        out["build_model_s"] = time.perf_counter() - start
        for lr in args.lrs:
            t = trainer(model, Path(d) / f"run_{lr}", args.max_len + 64, batching={"micro_batch_tokens": args.max_len * 2},
                        optim={"lr": lr})
            assert all(p.dtype == torch.float32 for p in t.model.parameters()), "masters are not float32"
            out["params"] = sum(p.numel() for p in t.model.parameters())
            base = gather_full_state_dict(t.model, torch.bfloat16)
            prev, rows, after, step_s, tokens = base, [], {}, [], []
            for step in range(1, args.steps + 1):
                batch = random_batch(args.samples, args.min_len, args.max_len, vocab, seed=step)
                tokens.append(int(batch.lengths.sum()))
                s0 = time.perf_counter()
                metrics = t.train_step(t.micro_batches(batch, t.policy), t.policy)
                step_s.append(time.perf_counter() - s0)
                cur = gather_full_state_dict(t.model, torch.bfloat16)
                row = model_delta(prev, cur, cap)
                row["loss"], row["grad_norm"] = metrics["loss"], metrics.get("grad_norm")
                rows.append(row)
                if step in ks:
                    after[str(step)] = row if step == 1 else model_delta(base, cur, cap)
                print(f"  lr {lr:g} step {step}: train {step_s[-1]:.1f}s, {100 * row['changed_frac']:.2f}% changed "
                      f"(vs step 0: {100 * (after.get(str(step)) or {}).get('changed_frac', float('nan')):.2f}%)",
                      flush=True)
                prev = cur
            out["lrs"][str(lr)] = {"per_step": rows, "after_k": after, "train_step_s": step_s, "tokens": tokens}
            del t, base, prev, cur
            gc.collect()
        out["wall_s"] = time.perf_counter() - start
    return out


# --- table -----------------------------------------------------------------------------------------

def pct(x: float) -> str:
    return f"{100 * x:.2f}%" if x < 0.1 else f"{100 * x:.1f}%"


def table(results: dict) -> str:
    lines = ["| run | lr | delta against | values changed | idx32 | gaps+zlib | bitmask+zlib | bitmask+ulps+zlib "
             "| idx32 encode / apply s | bitmask+ulps encode / zlib / apply s |", "|" + "---|" * 10]
    for key in sorted(results):
        r = results[key]
        label = f"{r['mode']} {r['shape']}"
        for lr, data in r["lrs"].items():
            rows = [(f"previous step (mean of {len(data['per_step'])})", mean_rows(data["per_step"]))]
            rows += [(f"step 0, k = {k}", row) for k, row in data["after_k"].items() if k != "1"]
            for against, row in rows:
                f = row["frac_of_full"]
                lines.append(f"| {label} | {float(lr):g} | {against} | {pct(row['changed_frac'])} | {pct(f['idx32'])} "
                             f"| {pct(f['gaps+zlib'])} | {pct(f['bitmask+zlib'])} | {pct(f['bitmask+ulps+zlib'])} "
                             f"| {row['encode_s']:.2f} / {row['apply_s']:.2f} "
                             f"| {row['encode_ulps_s']:.2f} / {row['zlib_ulps_s']:.2f} / {row['apply_ulps_s']:.2f} |")
    return "\n".join(lines)


def mean_rows(rows: list[dict]) -> dict:
    n = len(rows)
    return {"changed_frac": sum(r["changed_frac"] for r in rows) / n,
            "frac_of_full": {e: sum(r["frac_of_full"][e] for r in rows) / n for e in ENCODINGS},
            **{k: sum(r[k] for r in rows) / n for k in TIMES}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["sim", "trainer", "table"])
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--compress-mb", type=int, default=16)
    args = ap.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.mode != "table":
        start = time.perf_counter()
        r = sim(args) if args.mode == "sim" else trainer_mode(args)
        r["torch_threads"] = torch.get_num_threads()
        r["compress_mb"] = args.compress_mb
        print(f"{args.mode} {args.shape}: {time.perf_counter() - start:.0f}s")
        if args.shape == "tiny":
            results = {"tiny": r}
        else:
            results[f"{args.mode}_{args.shape}"] = r
            RESULTS.parent.mkdir(exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
