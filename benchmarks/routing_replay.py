"""Routing replay on and off (trainer.routing_replay) on the MoE demo, by staleness.

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
import statistics

from rl_runs import ROOT, print_table, run_rl, save_results

LAYERS = 4  # models/tiny-moe


def summary(wall: float, records: list[dict], skip: int = 20) -> dict:
    trainer = [r for r in records if r["program"] == "trainer"][skip:]
    orch = [r["reward_sampled_mean"] for r in records if r["program"] == "orchestrator" and "reward_sampled_mean" in r]
    mean = lambda key: statistics.fmean(r[key] for r in trainer)  # noqa: E731
    span = trainer[-1]["time"] - trainer[0]["time"]
    return {"wall_s": round(wall, 1), "s_per_step": round(span / (len(trainer) - 1), 3),
            "mismatch_kl": mean("mismatch_kl"), "agreement": mean("routing_agreement"),
            "agreement_per_layer": [round(mean(f"routing_agreement/layer_{i}"), 4) for i in range(LAYERS)],
            "replayed_frac": mean("routing_replayed_frac"),
            "reward_first20": statistics.fmean(orch[:20]), "reward_last20": statistics.fmean(orch[-20:])}


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
                             "--trainer.routing_replay", str(replay).lower()]
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
