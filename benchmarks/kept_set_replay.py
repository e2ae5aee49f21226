"""Replayed vs rebuilt kept sets (orchestrator.sampling.record_kept_sets) on a top-p run, by staleness.

    .venv/bin/python benchmarks/kept_set_replay.py [--async-levels 0 1 2] [--steps 300] [--top-p 0.8]

The reversal recipe (configs/reverse_demo.toml: models/tiny-reverse, 8 prompts x 8) sampled at
T = 1 with top_p 0.8, each max_async_level run twice, one after the other: the trainer rebuilding
each kept set from its own logits (the default), and replaying the set the engine recorded. Per
run, over trainer steps 20 on: mismatch_kl (k3 KL between the engine's and the trainer's
logprobs of the sampled tokens), sampling_mask_miss_frac (sampled tokens the set lacked: the
rebuild's disagreement with the sampler), the replayed share, s/step; and the policy's reward
(`reward_sampled_mean`, trailing 20 steps) at the end. Results:
benchmarks/results/kept_set_replay.json and docs/trainer.md.
"""

from __future__ import annotations

import argparse
import json

from rl_runs import ROOT, print_table, run_rl, save_results, trainer_means


def summary(wall: float, records: list[dict]) -> dict:
    out = trainer_means(wall, records, ["mismatch_kl", "sampling_mask_miss_frac", "sampling_mask_replayed_frac"])
    out["miss_frac"], out["replayed_frac"] = out.pop("sampling_mask_miss_frac"), out.pop("sampling_mask_replayed_frac")
    out["max_staleness"] = max(r["max_staleness"] for r in records if r["program"] == "trainer")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--async-levels", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    results = []
    for level in args.async_levels:
        for mode in ("rebuild", "replay"):
            out = ROOT / "runs" / "bench" / f"kept_{mode}_async{level}"
            overrides = ["--max_steps", str(args.steps), "--max_async_level", str(level), "--seed", str(args.seed),
                         "--orchestrator.sampling.top_p", str(args.top_p), "--orchestrator.eval.every", "0",
                         "--orchestrator.sampling.record_kept_sets", str(mode == "replay").lower(),
                         "--inference.max_logprobs", "30"]  # the 30-character vocabulary: any set fits
            wall, records = run_rl("configs/reverse_demo.toml", out, overrides, timeout_s=3600)
            row = {"max_async_level": level, "mode": mode, **summary(wall, records)}
            print(json.dumps(row), flush=True)
            results.append(row)
    save_results("kept_set_replay", args, results)
    print_table(["max_async_level", "kept sets", "mismatch_kl", "sampled tokens missing from the set", "replayed",
                 "max staleness", "reward, first / last 20 steps", "s/step"],
                [[r["max_async_level"], r["mode"], f"{r['mismatch_kl']:.2e}", f"{r['miss_frac']:.2e}",
                  f"{r['replayed_frac']:.2f}", r["max_staleness"],
                  f"{r['reward_first20']:.3f} / {r['reward_last20']:.3f}", f"{r['s_per_step']:.3f}"] for r in results])

if __name__ == "__main__":
    main()
