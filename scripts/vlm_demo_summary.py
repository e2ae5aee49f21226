"""What `make vlm-demo` prints at the end: the held-out greedy accuracy (200 pictures the runs
never train on, tasks/shapes.py) before and after `rl sft` and before and after `rl run`, read
from each run's metrics.jsonl (the eval records of sft.eval_generate and orchestrator.eval),
and where the plots are.

    python scripts/vlm_demo_summary.py runs/vlm_sft runs/vlm_demo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEY = "eval/heldout/accuracy"


def accuracy_by_step(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("program") == "eval" and KEY in record:
            out[int(record["step"])] = float(record[KEY])
    return out


def rewards(run: Path) -> list[float]:
    """Each step's mean reward over every sample drawn (reward_sampled_mean): the batch's own
    (reward_mean) leaves out the groups filter_zero_variance drops, all right or all wrong."""
    return [r["reward_sampled_mean"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r.get("program") == "orchestrator" and "reward_sampled_mean" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sft", type=Path)
    ap.add_argument("rl", type=Path)
    args = ap.parse_args()
    sft, rl = accuracy_by_step(args.sft), accuracy_by_step(args.rl)
    if not sft or not rl:
        raise SystemExit(f"no {KEY} records in {args.sft / 'metrics.jsonl' if not sft else args.rl / 'metrics.jsonl'}")
    line = lambda acc: " -> ".join(f"{a:.3f} (step {s})" for s, a in sorted(acc.items()))
    print(f"held-out greedy accuracy, 200 pictures: rl sft  {line(sft)}")
    print(f"                                        rl run  {line(rl)}")
    first, last = min(rl), max(rl)
    print(f"RL over the SFT model: {rl[last] - rl[first]:+.3f} ({rl[first]:.3f} -> {rl[last]:.3f})")
    got = rewards(args.rl)
    if len(got) >= 20:
        k = min(50, len(got) // 2)
        print(f"reward of every sample drawn (first/last {k} steps): {sum(got[:k]) / k:.3f} -> {sum(got[-k:]) / k:.3f}")
    for plot in (args.sft / "loss_curve.png", args.rl / "reward_curve.png"):
        print(f"plot: {plot}" + ("" if plot.exists() else " (missing)"))


if __name__ == "__main__":
    main()
