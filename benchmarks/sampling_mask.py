"""Keep Sampling Mask (trainer.mismatch.sampling_mask): the demo sampled with top_p, learning with the mask
and without, same seeds; and the mask's cost in trainer step time at a real vocabulary size.

    python benchmarks/sampling_mask.py runs  [--top-p 0.8] [--seeds 0] [--steps 300]
    python benchmarks/sampling_mask.py cost  [--vocab 151936] [--tokens 512]

`runs` writes benchmarks/results/sampling_mask_runs.json (per run: reward curve, mismatch_kl,
step times, held-out accuracy, batch bytes) and benchmarks/results/sampling_mask_reward.png;
`cost` writes benchmarks/results/sampling_mask_cost_scale<scale>.json. Numbers: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))
RESULTS = ROOT / "benchmarks" / "results"


def summarise(records: list[dict], output_dir: Path) -> dict:
    trainer = [r for r in records if r["program"] == "trainer"]
    orch = [r for r in records if r["program"] == "orchestrator"]
    evals = [r for r in records if r["program"] == "eval"]
    rewards = [r["reward_mean"] for r in orch]
    batches = sorted((output_dir / "rollouts").glob("step_*"))
    return {
        "reward_curve": rewards,
        "reward_first5": statistics.mean(rewards[:5]), "reward_last5": statistics.mean(rewards[-5:]),
        "reward_last50": statistics.mean(rewards[-50:]),
        "heldout_accuracy": [(r["step"], r.get("eval/heldout/accuracy")) for r in evals],
        "mismatch_kl_median": statistics.median(r["mismatch_kl"] for r in trainer),
        "mismatch_kl_step1": trainer[0]["mismatch_kl"],
        "mismatch_kl_curve": [r["mismatch_kl"] for r in trainer],
        "miss_frac_mean": statistics.mean(r.get("sampling_mask_miss_frac", 0.0) for r in trainer),
        "truncated_frac_mean": statistics.mean(r.get("truncated_frac", 0.0) for r in trainer),
        "step_s_median": statistics.median(r["step_s"] for r in trainer[1:]),
        # The files of the kept batches (the latest keep_rollouts): what the batch format costs.
        "batch_bytes_mean": statistics.mean(sum(f.stat().st_size for f in b.iterdir()) for b in batches)
        if batches else None,
    }


def runs(args) -> None:
    from rl_runs import run_rl

    path = RESULTS / "sampling_mask_runs.json"
    out = json.loads(path.read_text()) if path.exists() else {}  # runs of other seeds stay
    for seed in args.seeds:
        for mask in (True, False):
            name = f"seed{seed}_{'mask' if mask else 'nomask'}"
            output_dir = ROOT / "runs" / "bench" / f"sampling_mask_{name}"
            wall, records = run_rl("configs/demo.toml", output_dir, [
                "--seed", str(seed), "--max_steps", str(args.steps), "--orchestrator.sampling.top_p", str(args.top_p),
                "--trainer.mismatch.sampling_mask", str(mask).lower()], timeout_s=3600)
            out[name] = {"wall_s": wall, "top_p": args.top_p, "seed": seed, "mask": mask,
                         **summarise(records, output_dir)}
            r = out[name]
            print(f"{name}: reward {r['reward_first5']:.3f} -> {r['reward_last5']:.3f} (last 50 "
                  f"{r['reward_last50']:.3f}), heldout {r['heldout_accuracy']}, mismatch_kl median "
                  f"{r['mismatch_kl_median']:.2e} (step 1 {r['mismatch_kl_step1']:.2e}), step "
                  f"{r['step_s_median'] * 1e3:.1f} ms, batch {r['batch_bytes_mean']:.0f} B, {wall:.0f} s", flush=True)
            RESULTS.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=1))
    plot(out)


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in out.items():
        curve = r["reward_curve"]
        smooth = [statistics.mean(curve[max(0, i - 19):i + 1]) for i in range(len(curve))]
        ax.plot(range(1, len(curve) + 1), smooth, label=name)
        bx.semilogy(range(1, len(r["mismatch_kl_curve"]) + 1), [max(x, 1e-12) for x in r["mismatch_kl_curve"]],
                    label=name, lw=0.7)
    ax.set(xlabel="step", ylabel="reward (trailing 20 steps)", title=f"demo, top_p {r['top_p']}")
    bx.set(xlabel="step", ylabel="mismatch_kl", title="trainer vs sampler logprobs")
    ax.legend(), bx.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "sampling_mask_reward.png", dpi=110)


def cost(args) -> None:
    """Forward + backward of the logprob step alone (token_logprobs_and_entropy) on random
    logits [1, tokens, vocab], untruncated vs top_p / top_k / both: the mask's whole cost (one
    no-grad sort of the vocabulary per truncated token, a masked log_softmax)."""
    import torch

    from trainer.loss import token_logprobs_and_entropy
    from trainer.sampling_mask import NO_TRUNCATION, Truncation

    torch.manual_seed(0)
    n, vocab = args.tokens, args.vocab
    # scale sets how peaked the distribution is: 3 is nearly flat over 152k tokens (top_p 0.8
    # keeps tens of thousands: the worst case), 8 keeps a few hundred, as a trained LM would.
    logits0 = torch.randn(1, n + 1, vocab) * args.scale
    tokens = torch.randint(0, vocab, (1, n + 1))
    cases = {"off": None, "top_p 0.8": (-1, 0.8), "top_k 50": (50, 1.0), "top_k 50 + top_p 0.8": (50, 0.8)}
    out = {"vocab": vocab, "tokens": n, "scale": args.scale, "threads": torch.get_num_threads()}
    for name, setting in cases.items():
        times = []
        for _ in range(args.repeat):
            logits = logits0.clone().requires_grad_(True)
            trunc = NO_TRUNCATION if setting is None else Truncation(
                torch.full((1, n), setting[0]), torch.full((1, n), setting[1]), torch.zeros(1, n),
                torch.ones(1, n, dtype=torch.bool))
            start = time.perf_counter()
            lp, _ = token_logprobs_and_entropy(logits, tokens, 0.7, trunc)
            lp.sum().backward()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
        print(f"{name}: {out[name] * 1e3:.1f} ms for {n} tokens x {vocab} vocab (scale {args.scale})", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"sampling_mask_cost_scale{args.scale:g}.json").write_text(json.dumps(out, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("runs")
    r.add_argument("--top-p", type=float, default=0.8)
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--steps", type=int, default=300)
    c = sub.add_parser("cost")
    c.add_argument("--vocab", type=int, default=151936)  # Qwen2/2.5's
    c.add_argument("--tokens", type=int, default=512)
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--scale", type=float, default=8.0)
    args = p.parse_args()
    runs(args) if args.what == "runs" else cost(args)


if __name__ == "__main__":
    main()
