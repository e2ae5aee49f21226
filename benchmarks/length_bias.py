"""Do staleness cancels and first-finished batching bias training toward short completions?

    .venv/bin/python benchmarks/length_bias.py [--steps 30]

The generation-heavy recipe (configs/long.toml: models/long-count counts on for 16 characters per
letter of an 8-16 letter word, so a prompt fixes its completion's length, 128-256 tokens) run
twice, one after the other: "sync" (max_async_level 0 and no oversampling: each batch is exactly
the groups drawn for it) and the config's own async setting (max_async_level 2, 8 groups in
flight for batches of 4: a batch takes the first groups to finish, and groups that fall too far
behind are cancelled and their prompts requeued). Every batch is kept and read back: per batched
group, the length its prompt asks for (16 x the word's letters) and the completions' mean length.
A bias shows as shorter prompts in the async run's batches than in the sync run's, whose
composition is the draw's own. Results: benchmarks/results/length_bias.json and
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics

from rl_runs import ROOT, ensure_long_model, print_table, run_rl, save_results

from rl.batch import Batch
from rl.rundir import RunDir

VARIANTS = {
    "sync": ["--max_async_level", "0", "--orchestrator.scheduling.max_in_flight_groups", "4"],
    "async": [],  # configs/long.toml: max_async_level 2, max_in_flight_groups 8
    # Tighter and more oversampled: groups wait longer in flight and go stale sooner.
    "tight": ["--max_async_level", "1", "--orchestrator.scheduling.max_in_flight_groups", "16"],
}


def batched_groups(run: RunDir, steps: int) -> list[dict]:
    """Per batched group: the step, the prompt's asked length and the completions' mean length."""
    groups = []
    for step in range(1, steps + 1):
        batch = Batch.read(run.rollout_dir(step))
        by_prompt: dict[tuple, list[int]] = {}
        for s in batch.sample_slices():
            mask = batch.loss_mask[s]
            first = int(mask.argmax())
            by_prompt.setdefault(tuple(batch.tokens[s][:first].tolist()), []).append(int(mask.sum()))
        for prompt, lengths in by_prompt.items():
            groups.append({"step": step, "asked": 16 * (len(prompt) - 1), "length": statistics.fmean(lengths)})
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    ensure_long_model()

    results = []
    for name in args.variants:
        overrides = VARIANTS[name]
        out = ROOT / "runs" / "bench" / f"length_bias_{name}"
        wall, records = run_rl("configs/long.toml", out, ["--max_steps", str(args.steps), "--seed", str(args.seed),
                                                           "--trainer.files.keep_rollouts", str(args.steps), *overrides],
                               timeout_s=3600)
        groups = batched_groups(RunDir(out), args.steps)
        orch = [r for r in records if r["program"] == "orchestrator" and "reward_mean" in r]
        row = {"variant": name, "wall_s": round(wall, 1), "groups": len(groups),
               "asked_mean": round(statistics.fmean(g["asked"] for g in groups), 1),
               "length_mean": round(statistics.fmean(g["length"] for g in groups), 1),
               "short_half": round(sum(g["asked"] <= 192 for g in groups) / len(groups), 3),
               "cancelled": sum(r["cancelled"] for r in orch), "dropped_stale": sum(r["dropped_stale"] for r in orch),
               "staleness_mean": round(statistics.fmean(r["staleness_mean"] for r in orch), 2)}
        print(json.dumps(row), flush=True)
        results.append(row)
    save_results(f"length_bias_{'_'.join(args.variants)}", args, results)
    print_table(["variant", "batched groups", "asked length, mean", "completion length, mean", "asked <= 192",
                 "groups cancelled", "dropped stale", "staleness", "wall s"],
                [[r[k] for k in ("variant", "groups", "asked_mean", "length_mean", "short_half", "cancelled",
                                 "dropped_stale", "staleness_mean", "wall_s")] for r in results])

if __name__ == "__main__":
    main()
