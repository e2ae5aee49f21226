"""Async vs sync on the generation-heavy workload (configs/long.toml): the same config and seed
with max_async_level 2 and 0, run one after the other, `repeats` times alternating the order.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 16] [--skip 3] [--repeats 1]

Reports steps/s over the trainer steps after the first `skip` (vLLM's first reload and warm-up),
their ratio, and how idle each side was. Builds models/long-count first if it is missing.
Results: benchmarks/results/async_vs_sync.json and docs/performance.md.
"""

from __future__ import annotations

import argparse
import json

from rl_runs import ROOT, ensure_long_model, run_rl, window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/long.toml")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--levels", type=int, nargs=2, default=[2, 0], metavar=("ASYNC", "SYNC"))
    ap.add_argument("--out", default="benchmarks/results/async_vs_sync.json")
    args, extra = ap.parse_known_args()
    ensure_long_model()
    samples = _samples_per_step(args.config, extra)
    runs: dict[int, list[dict]] = {level: [] for level in args.levels}
    for i in range(args.repeats):
        for level in (args.levels if i % 2 == 0 else args.levels[::-1]):
            out = ROOT / "runs" / "bench" / f"async_vs_sync_level{level}"
            wall, records = run_rl(args.config, out, ["--max_async_level", str(level), "--max_steps",
                                                      str(args.steps), *extra], timeout_s=3600)
            w = window(records, args.skip, samples) | {"wall_s": wall}
            runs[level].append(w)
            print(f"max_async_level {level}: {w['steps_per_s']:.4f} steps/s, trainer idle "
                  f"{w['trainer_idle_frac']:.0%}, inference idle {w['inference_idle_frac']:.0%}, "
                  f"{w['mean_completion_tokens']:.0f} tokens/completion", flush=True)
    fast, slow = args.levels
    ratios = [a["steps_per_s"] / s["steps_per_s"] for a, s in zip(runs[fast], runs[slow])]
    result = {"config": args.config, "overrides": extra, "steps": args.steps, "skip": args.skip,
              "runs": {str(k): v for k, v in runs.items()}, "speedup": ratios}
    (ROOT / args.out).parent.mkdir(parents=True, exist_ok=True)
    (ROOT / args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"async (level {fast}) / sync (level {slow}) steps/s: " + ", ".join(f"{r:.2f}x" for r in ratios))


def _samples_per_step(config: str, overrides: list[str]) -> int:
    import sys
    sys.path.insert(0, str(ROOT / "src"))
    from rl.config import load_config
    cfg, _ = load_config(["@", str(ROOT / config), *overrides])
    return cfg.orchestrator.scheduling.prompts_per_step * cfg.orchestrator.scheduling.group_size


if __name__ == "__main__":
    main()
