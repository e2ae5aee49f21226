"""The trainer's step at the hardware's pace (issue 51): MFU and peak memory of one step of 128
samples of 128-1024 tokens (78,276 with its seed) through `Trainer.train_step`, as `rl trainer` runs it
(FSDP2 on one rank, the chunked logprob head, trainer.model.dtype auto: bfloat16 on CUDA), on random
Qwen2.5-0.5B- and 1.5B-shaped models built from their config (no download), per variant:

    sdpa_8k                  sdpa (block-diagonal [T, T] mask per packed row: what auto ran before issue 60), eager
    sdpa_compile_8k          the same with trainer.model.compile (each decoder layer compiled)
    varlen_{8k,16k,32k}      trainer.model.attention = "varlen" (torch's own varlen flash kernel), eager
    varlen_compile_{8k,16k,32k}   varlen and compiled: the fast setting
    varlen_compile_ac_32k    the same with activation checkpointing (memory for speed)
    trl                      a TRL-like step for comparison: float32 weights, bfloat16 autocast, rows
                             padded per micro-batch of 8 samples, full logits, AdamW; no FSDP

8k/16k/32k: trainer.batching.micro_batch_tokens 8192/16384/32768 (rows of seq_len 1024). Each variant runs
in its own process: a warm-up step (compiling, AdamW's state), then --repeats timed steps, the
best reported. MFU = 6 x parameters x tokens per second / the device's peak (989 TFLOP/s for an
H100 or H200 in dense bfloat16: --peak-tflops); peak memory: torch.cuda.max_memory_allocated over
the timed steps (on CPU the process's peak resident size).

    .venv/bin/python benchmarks/trainer_gpu.py                       # both shapes, every variant (GPU)
    .venv/bin/python benchmarks/trainer_gpu.py --shapes 0.5b --variants sdpa_8k varlen_compile_32k trl
    .venv/bin/python benchmarks/trainer_gpu.py --tiny                # tiny shapes and batch: runs on CPU

On a GPU the whole table takes ~30 min (18 processes, the 1.5B ones each loading 6 GB and
compiling); a 15-minute lease fits one shape and a few variants. GPU figures: pending (no GPU was
lent to the session that wrote this; it ran only --tiny on CPU: 12 min on 2 cores, every variant
ran). Results: printed, and (not --tiny) written to benchmarks/results/trainer_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import trainer_step
from trainer_step import ROOT, build_model, peak_gb, peak_reset, random_batch, timed_steps, trainer

SHAPES = {
    "0.5b": trainer_step.SHAPES["0.5b"],
    # Qwen2.5-1.5B's shape (1.54B parameters, tied embeddings).
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
}
TINY_SHAPES = {  # the same head_dim (64) and GQA, a CPU's size
    "0.5b": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512),
    "1.5b": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=3,
                 num_key_value_heads=1, vocab_size=512),
}
# (samples, shortest, longest, seq_len, micro_batch_tokens for 8k / 16k / 32k)
WORKLOAD = {"full": (128, 128, 1024, 1024, {"8k": 8192, "16k": 16384, "32k": 32768}),
            "tiny": (16, 16, 128, 128, {"8k": 256, "16k": 512, "32k": 1024})}
# name -> (trainer.model.attention, trainer.model.compile, micro-batch tokens, activation_checkpointing);
# trl: trl_step instead of the Trainer.
VARIANTS = {
    "sdpa_8k": ("sdpa", False, "8k", False),
    "sdpa_compile_8k": ("sdpa", True, "8k", False),
    "varlen_8k": ("varlen", False, "8k", False),
    "varlen_16k": ("varlen", False, "16k", False),
    "varlen_32k": ("varlen", False, "32k", False),
    "varlen_compile_8k": ("varlen", True, "8k", False),
    "varlen_compile_16k": ("varlen", True, "16k", False),
    "varlen_compile_32k": ("varlen", True, "32k", False),
    "varlen_compile_ac_32k": ("varlen", True, "32k", True),
    "trl": None,
}
TRL_SAMPLES_PER_MICRO_BATCH = 8


def kernel_line(attention: str, device: torch.device, dtype: str) -> str | None:
    """What "varlen" ran as (trainer/packed_attention.py's start-up line): the flash kernel and how
    this torch takes GQA, or SDPA per block."""
    if attention != "varlen":
        return None
    from trainer import packed_attention

    return packed_attention.describe(device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)


def workload_batch(tiny: bool, vocab: int):
    samples, lo, hi, _, _ = WORKLOAD["tiny" if tiny else "full"]
    return random_batch(samples, lo, hi, vocab, seed=51)


def run_variant(args) -> None:
    """One variant in this process; its figures as JSON to args.out."""
    batch = workload_batch(args.tiny, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    if VARIANTS[args.variant] is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        params, step = trl_step(Path(args.model), batch, device)
        attention, dtype = "sdpa", "amp-bf16" if device.type == "cuda" else "float32"
    else:
        t = variant_trainer(args)
        device, params = t.device, sum(p.numel() for p in t.model.parameters())
        attention, dtype = t.model.config._attn_implementation, t.dtype

        def step() -> float:
            return timed_steps(t, batch, 1)[0]
    start = time.perf_counter()
    step()  # warm-up: compiling, AdamW's state
    warmup_s = time.perf_counter() - start
    peak_reset(device)
    times = [step() for _ in range(args.repeats)]
    Path(args.out).write_text(json.dumps({
        "variant": args.variant, "tokens": int(batch.lengths.sum()), "params": params, "step_s": min(times),
        "steps_s": times, "warmup_s": warmup_s, "peak_gib": peak_gb(device) * 1e9 / 2 ** 30,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": dtype,
        "attention": attention, "kernel": kernel_line(attention, device, dtype)}))


def variant_trainer(args):
    """The real Trainer (trainer_step.trainer: `rl trainer`'s, one rank) with the variant's keys."""
    attention, compiled, size, ac = VARIANTS[args.variant]
    _, _, _, seq_len, tokens_per = WORKLOAD["tiny" if args.tiny else "full"]
    return trainer(Path(args.model), Path(args.out).parent / args.variant, seq_len,
                   model={"attention": attention, "compile": compiled, "activation_checkpointing": ac},
                   batching={"micro_batch_tokens": tokens_per[size]})


def trl_step(model_path: Path, batch, device: torch.device):
    """(parameters, a function running one step): TRL's way, for comparison: float32 weights
    under bfloat16 autocast (CUDA), samples in batch order padded per micro-batch, full logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    slices, n = batch.sample_slices(), TRL_SAMPLES_PER_MICRO_BATCH
    groups = [slices[i:i + n] for i in range(0, len(slices), n)]

    def padded(group, field, fill):
        width = max(s.stop - s.start for s in group)
        out = torch.full((len(group), width), fill, dtype=torch.from_numpy(field[:0]).dtype)
        for r, s in enumerate(group):
            out[r, :s.stop - s.start] = torch.from_numpy(field[s])
        return out.to(device)

    def step() -> float:
        start = time.perf_counter()
        for group in groups:
            tokens, mask = padded(group, batch.tokens, 0), padded(group, batch.loss_mask.astype("float32"), 0.0)
            adv = padded(group, batch.advantages, 0.0)
            attention = padded(group, (batch.tokens * 0 + 1).astype("int64"), 0)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=tokens, attention_mask=attention).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
            loss = -(logp * adv[:, 1:] * mask[:, 1:]).sum() / mask[:, 1:].sum().clamp(min=1) / len(groups)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return sum(p.numel() for p in model.parameters()), step


def table(results: list[dict], peak_tflops: float | None) -> str:
    lines = [f"{'shape':6} {'variant':24} {'attention':10} {'dtype':9} {'step s':>7} {'tokens/s':>9} {'MFU':>6} "
             f"{'peak GiB':>9}  warm-up s"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['shape']:6} {r['variant']:24} failed: {r['error']}")
            continue
        rate = r["tokens"] / r["step_s"]
        mfu = f"{6 * r['params'] * rate / (peak_tflops * 1e12):6.1%}" if peak_tflops else "     -"
        lines.append(f"{r['shape']:6} {r['variant']:24} {r['attention']:10} {r['dtype'][:9]:9} {r['step_s']:7.2f} "
                     f"{rate:9,.0f} {mfu} {r['peak_gib']:9.1f}  {r['warmup_s']:.0f}")
    kernels = sorted({r["kernel"] for r in results if r.get("kernel")})
    lines += [f"varlen ran as: {k}" for k in kernels]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and batch, for checking it runs (CPU)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak; default 989 on CUDA")
    ap.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        return run_variant(args)
    peak = args.peak_tflops or (989.0 if torch.cuda.is_available() else None)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for shape in args.shapes:
            trainer_step.SHAPES[f"gpu-{shape}"] = (TINY_SHAPES if args.tiny else SHAPES)[shape]
            model = build_model(f"gpu-{shape}", Path(d) / shape)
            for variant in args.variants:
                out = Path(d) / f"{shape}-{variant}.json"
                run = subprocess.run([sys.executable, __file__, "--variant", variant, "--model", str(model),
                                      "--out", str(out), "--repeats", str(args.repeats)] + ["--tiny"] * args.tiny,
                                     capture_output=True, text=True)
                r = json.loads(out.read_text()) if run.returncode == 0 else {
                    "variant": variant, "error": (run.stderr.strip().splitlines() or ["?"])[-1][-160:]}
                results.append({"shape": shape, **r})
                print(table(results[-1:], peak).splitlines()[-1], flush=True)
    print(table(results, peak))
    if not args.tiny:  # --tiny checks that it runs: its figures are nobody's result
        out = ROOT / "benchmarks" / "results" / "trainer_gpu.json"
        out.write_text(json.dumps({"peak_tflops": peak, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
