"""Routing replay on and off (trainer.mismatch.routing_replay) on the MoE demo, by staleness.

    .venv/bin/python benchmarks/routing_replay.py [--async-levels 0 1] [--steps 300] [--seeds 0]

configs/moe_demo.toml (models/tiny-moe: 4 layers, each 4 experts top 2; string reversal, 8
prompts x 8), the engine recording its routing in every run (inference.record_routing), each
max_async_level run twice, one after the other: the trainer routing by itself, and replaying the
engine's record. Per run, over trainer steps 20 on: routing_agreement (positions where the
trainer's own top-k is the engine's; per layer too), mismatch_kl (k3 KL between the engine's and
the trainer's logprobs of the sampled tokens), s/step; and the policy's reward
(`reward_sampled_mean`, first and last 20 steps). Results: benchmarks/results/routing_replay.json
and docs/moe.md.
"""

from __future__ import annotations

import argparse
import json

from rl_runs import ROOT, print_table, run_rl, save_results, trainer_means

LAYERS = 4  # models/tiny-moe


def summary(wall: float, records: list[dict]) -> dict:
    layers = [f"routing_agreement/layer_{i}" for i in range(LAYERS)]
    out = trainer_means(wall, records, ["mismatch_kl", "routing_agreement", "routing_replayed_frac", *layers])
    out["agreement"], out["replayed_frac"] = out.pop("routing_agreement"), out.pop("routing_replayed_frac")
    out["agreement_per_layer"] = [round(out.pop(k), 4) for k in layers]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--async-levels", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args()

    results = []
    for seed in args.seeds:
        for level in args.async_levels:
            for replay in (False, True):
                out = ROOT / "runs" / "bench" / f"routing_{'replay' if replay else 'own'}_async{level}_{seed}"
                overrides = ["--max_steps", str(args.steps), "--max_async_level", str(level), "--seed", str(seed),
                             "--trainer.mismatch.routing_replay", str(replay).lower()]
                wall, records = run_rl("configs/moe_demo.toml", out, overrides, timeout_s=3600)
                row = {"seed": seed, "max_async_level": level, "replay": replay, **summary(wall, records)}
                print(json.dumps(row), flush=True)
                results.append(row)
    save_results("routing_replay", args, results)
    print_table(["seed", "max_async_level", "routing", "routing agreement (layers 0-3)", "mismatch_kl",
                 "reward, first / last 20 steps", "s/step"],
                [[r["seed"], r["max_async_level"], "replayed" if r["replay"] else "own",
                  f"{r['agreement']:.3f} ({', '.join(f'{a:.3f}' for a in r['agreement_per_layer'])})",
                  f"{r['mismatch_kl']:.2e}", f"{r['reward_first20']:.3f} / {r['reward_last20']:.3f}",
                  f"{r['s_per_step']:.3f}"] for r in results])


if __name__ == "__main__":
    main()
