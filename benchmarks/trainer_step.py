"""The trainer's step on CPU, through the real Trainer (FSDP2, one rank): packed vs padded
micro-batches on variable-length samples, one step of a 0.5B-class random model, and the
logits' memory at a real vocabulary (full logits vs the chunked head vs no logits at all).

    .venv/bin/python benchmarks/trainer_step.py packing [--samples 64] [--repeats 3]
    .venv/bin/python benchmarks/trainer_step.py large
    .venv/bin/python benchmarks/trainer_step.py logits [--seq-len 4096] [--variants full chunked no_logits]

Random Qwen2 models are built into a temporary directory (no download). Results are printed and
written to benchmarks/results/trainer_step_<mode>.json; summary in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rl.batch import Batch, Sample  # noqa: E402
from rl.config import RunConfig  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

SHAPES = {
    # A small model whose step time is compute, not Python overhead.
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048),
    # Qwen2.5-0.5B's shape (494M parameters, tied embeddings).
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
}


def build_model(shape: str, directory: Path) -> Path:
    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


def random_batch(samples: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> Batch:
    """Prompts of 16-48 tokens, completions so that lengths spread uniformly up to max_len, as
    in RL where some completions stop early and others run to the limit."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(samples):
        total = int(rng.integers(min_len, max_len + 1))
        p = min(int(rng.integers(16, 49)), total - 1)
        completion = rng.integers(1, vocab, size=total - p).tolist()
        prompt, c = rng.integers(1, vocab, size=p).tolist(), len(completion)
        logprobs, advantage = (-rng.random(c)).tolist(), float(rng.normal())
        out.append(Sample(prompt + completion, [0] * p + [1] * c, [0.0] * p + logprobs,
                          [0.0] * p + [advantage] * c, [-1] * p + [0] * c, reward=0.0))
    return Batch.from_samples(1, out)


def trainer(model: Path, out: Path, seq_len: int, **trainer_keys) -> Trainer:
    """`trainer_keys`: tables (and keys) of [trainer]."""
    cfg = RunConfig.model_validate({"model": str(model), "output_dir": str(out), "seq_len": seq_len,
                                    "trainer": {"torch_threads": torch.get_num_threads(), **trainer_keys}})
    return Trainer(cfg)


def timed_steps(t: Trainer, batch: Batch, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        t.train_step(t.micro_batches(batch, t.policy), t.policy)
        times.append(time.perf_counter() - start)
    return times


def packing(args, tmp: Path) -> dict:
    model = build_model("small", tmp / "model")
    batch = random_batch(args.samples, 24, args.seq_len, SHAPES["small"]["vocab_size"])
    tokens = int(batch.lengths.sum())
    budget = args.micro_batch_size * args.seq_len  # same most tokens per forward for both layouts
    results = {}
    for name, keys in (("padded", {"pack": False, "micro_batch_size": args.micro_batch_size}),
                       ("packed", {"pack": True, "micro_batch_tokens": budget})):
        t = trainer(model, tmp / name, args.seq_len, batching=keys)
        mbs = t.micro_batches(batch, t.policy)
        timed_steps(t, batch, 1)  # warm-up
        times = timed_steps(t, batch, args.repeats)
        computed = sum(int(mb.tokens.numel()) for mb in mbs)
        results[name] = {"micro_batches": len(mbs), "tokens_computed": computed, "real_tokens": tokens,
                         "step_s": min(times), "tokens_per_s": tokens / min(times)}
        print(f"{name}: {len(mbs)} micro-batches, {computed} tokens computed for {tokens} real, "
              f"best step {min(times):.2f}s = {tokens / min(times):,.0f} real tokens/s", flush=True)
    results["speedup"] = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    print(f"packed / padded tokens/s: {results['speedup']:.2f}x")
    return {"samples": args.samples, "seq_len": args.seq_len, "shape": SHAPES["small"], **results}


def large(args, tmp: Path) -> dict:
    start = time.perf_counter()
    model = build_model("0.5b", tmp / "model")
    build_s = time.perf_counter() - start
    batch = random_batch(8, 96, 160, SHAPES["0.5b"]["vocab_size"])
    t = trainer(model, tmp / "run", 256, batching={"micro_batch_tokens": 512})
    params = sum(p.numel() for p in t.model.parameters())
    times = timed_steps(t, batch, args.repeats)
    tokens = int(batch.lengths.sum())
    start = time.perf_counter()
    write_s = t.publisher.publish(t.policy, 1)
    publish_s = time.perf_counter() - start
    print(f"0.5B-class ({params / 1e6:.0f}M params): {tokens} tokens, steps {', '.join(f'{s:.1f}s' for s in times)} "
          f"({tokens / min(times):,.0f} tokens/s); gather + write weights {publish_s:.1f}s (write {write_s:.1f}s)")
    return {"params": params, "tokens": tokens, "step_s": times, "tokens_per_s": tokens / min(times),
            "publish_s": publish_s, "write_s": write_s, "build_model_s": build_s}


VARIANTS = {
    # trainer.model.logits_chunk_tokens per variant; no_logits: the head returns the hidden states'
    # first two features instead of (logprob, entropy), so the step has everything but logits.
    "full": 0, "chunked": 1024, "no_logits": 1024,
}


def logits(args, tmp: Path) -> dict:
    """One subprocess per variant (peak memory is per process): a first step on a short batch
    allocates AdamW's state, then the measured step on seq_len tokens runs with it allocated
    all along, as every later step of a run does."""
    model = build_model(args.shape, tmp / "model")
    results = {}
    for variant in args.variants:
        out = tmp / f"{variant}.json"
        subprocess.run([sys.executable, __file__, "_logits_variant", "--variant", variant, "--model", str(model),
                        "--seq-len", str(args.seq_len), "--out", str(out), "--shape", args.shape], check=True)
        results[variant] = json.loads(out.read_text())
        r = results[variant]
        print(f"{variant}: peak {r['peak_gb']:.2f} GB, step {r['step_s']:.1f}s "
              f"({r['tokens_per_s']:.1f} tokens/s)", flush=True)
    if "no_logits" in results:
        for variant in results:
            results[variant]["peak_vs_no_logits"] = results[variant]["peak_gb"] / results["no_logits"]["peak_gb"]
    return {"shape": args.shape, "seq_len": args.seq_len, **results}


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:  # Linux: "5" resets the process's peak resident set size (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")


def peak_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024 / 1e9


def logits_variant(args) -> None:
    from trainer.logprob_head import LogprobHead

    vocab = SHAPES[args.shape]["vocab_size"]
    # 8 samples of seq_len / 8 tokens: one packed row of seq_len tokens per step.
    per = args.seq_len // 8
    batch = random_batch(8, per, per, vocab)
    t = trainer(Path(args.model), Path(args.out).parent / args.variant, args.seq_len,
                batching={"micro_batch_tokens": args.seq_len},
                model={"activation_checkpointing": True, "logits_chunk_tokens": VARIANTS[args.variant]})
    if args.variant == "no_logits":
        LogprobHead.forward = lambda self, hidden: hidden[..., :2].float()
    timed_steps(t, random_batch(2, 32, 32, vocab), 1)  # AdamW's state, cheaply
    before_gb = peak_gb(t.device)
    peak_reset(t.device)
    (step_s,) = timed_steps(t, batch, 1)
    tokens = int(batch.lengths.sum())
    Path(args.out).write_text(json.dumps({
        "tokens": tokens, "loss_tokens": int(batch.loss_mask.sum()), "step_s": step_s,
        "tokens_per_s": tokens / step_s, "peak_gb": peak_gb(t.device), "peak_before_gb": before_gb,
        "params": sum(p.numel() for p in t.model.parameters()), "device": str(t.device)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["packing", "large", "logits", "_logits_variant"])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--variant", choices=list(VARIANTS))
    ap.add_argument("--model")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.mode == "_logits_variant":
        return logits_variant(args)
    if args.mode == "logits" and args.seq_len == 512:
        args.seq_len = 4096
    with tempfile.TemporaryDirectory() as d:
        result = {"packing": packing, "large": large, "logits": logits}[args.mode](args, Path(d))
    result["torch_threads"] = torch.get_num_threads()
    suffix = f"_{args.shape}" if args.mode == "logits" else ""
    out = ROOT / "benchmarks" / "results" / f"trainer_step_{args.mode}{suffix}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
