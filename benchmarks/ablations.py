"""What each learning knob does to reward in wall time: one recipe, a variant per knob (one or
more config overrides), two or more seeds each, every run launched as a user launches it
(`rl run`), one after the other on this machine.

    .venv/bin/python benchmarks/ablations.py [--recipe demo] [--variants default nofilter sync ...]
                                              [--seeds 0 1] [--steps 200] [--budget-s 90]

Per run: seconds per step (steps 20 on), each program's CPU seconds per step, the
policy's own reward (`reward_sampled_mean`: every scored sample, filtered groups included) as a
trailing-20 mean at --budget-s from launch and at the end, seconds from launch until that mean
first reaches --target, and the held-out greedy accuracy before and after (the recipe's eval).
The summary gives each variant's median and range over its seeds. Results:
benchmarks/results/ablations_<recipe>[_<tag>].json and docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

from rl_runs import ROOT, run_rl

RECIPES = {
    # The CPU demo (configs/demo.toml): reasoning-gym's spell_backward on models/tiny-chat,
    # 8 prompts x 8, exact-match reward; held-out greedy accuracy on 100 rows.
    "demo": ("configs/demo.toml", ["--orchestrator.eval.every", "0"]),
    # The train-bound recipe (configs/reverse_demo.toml): the char-level model reverses strings,
    # 8 prompts x 8, 12-token completions; the trainer's step is most of the machine's work.
    "reverse": ("configs/reverse_demo.toml", []),
}

PAIR = re.compile(r"\[\s+([-\d.e]+),\s+([-\d.e]+)\s+\]")  # a curve's [seconds, reward] on one line

VARIANTS = {
    "default": [],
    "async1": ["--max_async_level", "1"],
    "nofilter": ["--orchestrator.scheduling.filter_zero_variance", "false"],
    "sync": ["--max_async_level", "0"],
    "async2": ["--max_async_level", "2"],
    "nonorm": ["--orchestrator.scheduling.normalize_advantages", "false"],
    "seqnorm": ["--trainer.loss.normalization", "sequence"],
    "tis": ["--trainer.loss.objective", "truncated_is"],
    "lr2x": ["--trainer.optim.lr", "2e-4"],
    "orch_core1": ["--orchestrator.cpus", "[1]"],
    "async3": ["--max_async_level", "3"],
    "async2_tis": ["--max_async_level", "2", "--trainer.loss.objective", "truncated_is"],
    "async2_lr2x": ["--max_async_level", "2", "--trainer.optim.lr", "2e-4"],
    "async2_nonorm": ["--max_async_level", "2", "--orchestrator.scheduling.normalize_advantages", "false"],
    # The trainer on both cores, two threads: the engine's core is idle part of a train-bound step.
    "trainer2": ["--trainer.cpus", "[0, 1]", "--trainer.torch_threads", "2"],
    "async2_trainer2": ["--max_async_level", "2", "--trainer.cpus", "[0, 1]", "--trainer.torch_threads", "2"],
    # Weights loaded between two decode steps: the engine neither drains running requests
    # (pause mode "wait", their batch shrinking to nothing) nor holds new ones back first.
    "inflight": ["--orchestrator.scheduling.in_flight_updates", "true"],
}


def trailing(values: list[float], n: int = 20) -> list[float]:
    return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def summarize_run(records: list[dict], budget_s: float, target: float) -> dict:
    orch = [r for r in records if r["program"] == "orchestrator" and "reward_sampled_mean" in r]
    trainer = [r for r in records if r["program"] == "trainer"]
    evals = [r for r in records if r["program"] == "eval"]
    smooth = trailing([r["reward_sampled_mean"] for r in orch])
    at_budget = [s for r, s in zip(orch, smooth) if r["since_launch"] <= budget_s]
    reached = next((r["since_launch"] for r, s in zip(orch[19:], smooth[19:]) if s >= target), None)
    steady = trainer[19:]
    accuracy = {r["step"]: v for r in evals for k, v in r.items() if k.endswith("/accuracy")}
    return {
        "first_step_s": round(trainer[0]["since_launch"], 1),
        "s_per_step": round((steady[-1]["since_launch"] - steady[0]["since_launch"]) / max(len(steady) - 1, 1), 3),
        "trainer_step_s": round(statistics.mean(r["step_s"] for r in steady), 3),
        "trainer_wait_s": round(statistics.mean(r["wait_s"] for r in steady), 3),
        "reward_at_budget": round(at_budget[-1], 3) if at_budget else None,
        "reward_end": round(smooth[-1], 3),
        "time_to_target_s": round(reached, 1) if reached is not None else None,
        "accuracy": {str(k): round(v, 3) for k, v in sorted(accuracy.items())},
        "end_s": round(orch[-1]["since_launch"], 1),
        # Every 5th step of the trailing mean: enough for a plot, a results file a person can read.
        "curve": [[round(r["since_launch"], 1), round(s, 3)] for r, s in list(zip(orch, smooth))[::5]],
    }


def spread(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):g} ({min(values):g}-{max(values):g})" if len(values) > 1 else f"{values[0]:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="demo")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["default", "nofilter", "sync"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=90.0, help="wall seconds from launch at which to compare")
    ap.add_argument("--tag", default="", help="results go to ablations_<recipe>_<tag>.json (a round of its own)")
    ap.add_argument("--stop-after-s", type=float, default=None,
                    help="stop each run this many seconds after launch (give --steps room): equal wall time")
    ap.add_argument("--target", type=float, default=0.25, help="trailing-20 reward_sampled_mean to time")
    args = ap.parse_args()
    config, base = RECIPES[args.recipe]
    out = ROOT / "benchmarks" / "results" / f"ablations_{args.recipe}{'_' + args.tag if args.tag else ''}.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    # Seeds outside, variants inside: a machine that slows down over the session (another job, heat)
    # then weighs on every variant alike instead of on the last ones.
    for seed in args.seeds:
        for variant in args.variants:
            overrides = [*base, *VARIANTS[variant], "--seed", str(seed), "--max_steps", str(args.steps)]
            cpu: dict[str, float] = {}
            _, records = run_rl(config, ROOT / "runs" / "ablations" / f"{args.recipe}-{variant}-{seed}", overrides,
                                timeout_s=60 + 3 * args.steps, cpu_s=cpu, stop_after_s=args.stop_after_s)
            run = summarize_run(records, args.budget_s, args.target)
            steps = sum(r["program"] == "trainer" for r in records)
            run["cpu_s_per_step"] = {k: round(v / max(steps, 1), 3) for k, v in cpu.items()}
            results.setdefault(variant, {})[str(seed)] = {"overrides": VARIANTS[variant], "steps": args.steps,
                                                          "budget_s": args.budget_s, "target": args.target, **run}
            out.write_text(PAIR.sub(r"[\1, \2]", json.dumps(results, indent=1)) + "\n")
            print(f"{variant} seed {seed}: " + ", ".join(f"{k} {v}" for k, v in run.items() if k != "curve"), flush=True)
    print(f"\n| variant | s/step | first step s | reward at {args.budget_s:g} s | reward at end | s to {args.target} | accuracy end |")
    print("|---|---|---|---|---|---|---|")
    for variant, runs in results.items():
        rs = list(runs.values())
        print(f"| {variant} | {spread([r['s_per_step'] for r in rs])} | {spread([r['first_step_s'] for r in rs])} | "
              f"{spread([r['reward_at_budget'] for r in rs])} | {spread([r['reward_end'] for r in rs])} | "
              f"{spread([r['time_to_target_s'] for r in rs])} | "
              f"{spread([list(r['accuracy'].values())[-1] if r['accuracy'] else None for r in rs])} |")


if __name__ == "__main__":
    main()
