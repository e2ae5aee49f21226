"""Curriculum by pass rate against uniform sampling, in wall time, on the demo's task.

    .venv/bin/python benchmarks/curriculum.py [--rows 200] [--steps 300] [--seeds 0]

configs/demo.toml (models/tiny-chat, reasoning-gym spell_backward, exact-match reward, 8 prompts
x 8, zero-variance filtering on) with its training rows cut to --rows, so that they come round
every rows / 8 steps: words of 3 to 7 letters, a mix of rows the model always, never and
sometimes spells right. Each seed runs, one after the other: uniform (every drawn row
generated), curriculum (the defaults: rows all of whose rollouts passed, and rows never passed
that failed 3 groups in a row, skipped but for 10% revisits) and easy_only (rows all of whose
rollouts passed skipped, hard ones always generated). Per run: wall seconds, the groups generated
and those filtered for zero variance (generation spent for nothing), rows skipped, the policy's own reward
(`reward_sampled_mean`, over the rows each run chose to generate: not comparable between the two)
as a trailing-20 mean at the end and its first time at --target, and greedy accuracy at steps 0,
100, 200, 300 on the training pool (what the curriculum should learn sooner) and on 200 held-out
rows never trained on. Results:
benchmarks/results/curriculum*.json and docs/datasets.md; --eval-every 50 for finer curves,
--budget-s to give every mode the same wall time, --plot FILE for pool accuracy against time,
--replot RESULTS to redraw one (docs/curriculum_wall_time.png) and print accuracy at fixed times
and the seconds to fixed accuracies.

--beyond-rows N adds a second training dataset drawn as often as the first: N rows of 9-12 letter
words whose answers (7-10 tokens) cannot fit the 6 tokens that dataset samples, so no rollout of
them is ever right (rows beyond the model's reach, as real datasets have: unsolvable or
mislabelled items). Uniform sampling generates and then filters every one of their groups; a
curriculum skips them once judged hard. Mode curriculum3 judges a row hard only after 3 failed
groups in a row (hard_after 3), curriculum4 after 4; curriculum3_r3 also revisits hard rows at 0.3
instead of 0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from ablations import trailing
from rl_runs import ROOT, print_table, run_rl, save_results


POOL_EVAL = """
[[orchestrator.eval.datasets]]
name = "pool"
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 3, max_word_len = 7 }}
size = {rows}
"""


def summary(wall: float, records: list[dict], target: float) -> dict:
    orch = [r for r in records if r["program"] == "orchestrator" and "reward_sampled_mean" in r]
    curve = trailing([r["reward_sampled_mean"] for r in orch])
    reached = next((r["since_launch"] for r, v in zip(orch, curve) if v >= target), None)
    evals = [r for r in records if "eval/heldout/accuracy" in r]
    pool = [r["eval/pool/accuracy"] for r in records if "eval/pool/accuracy" in r]
    return {"wall_s": round(wall, 1), "filtered": sum(r["filtered"] for r in orch),
            "generated": sum(r["filtered"] for r in orch) + 8 * len(orch),
            "skipped": sum(r.get("curriculum/skipped", 0) for r in orch),
            "reward_trailing20_end": round(curve[-1], 3),
            "target_s": None if reached is None else round(reached, 1),
            "heldout_accuracy": [r["eval/heldout/accuracy"] for r in evals], "pool_accuracy": pool,
            "pool_s": pool_times(records)}


def pool_times(records: list[dict]) -> list[float]:
    """When each pool evaluation ran: seconds from the run's first record (its first batch, ~15 s
    after launch in every mode)."""
    first = min(r["time"] for r in records)
    return [round(r["time"] - first, 1) for r in records if "eval/pool/accuracy" in r]


BEYOND = """
[[orchestrator.datasets]]
name = "beyond"
reasoning_gym = "spell_backward"
task_config = {{ min_word_len = 9, max_word_len = 12 }}
size = {rows}
max_tokens = 6
reward_weights = {{ score = 0.0, correct = 1.0 }}
"""

MODES = {
    "uniform": ["--orchestrator.curriculum.enabled", "false"],
    "curriculum": ["--orchestrator.curriculum.enabled", "true"],
    # Easy rows skipped, hard ones always generated.
    "easy_only": ["--orchestrator.curriculum.enabled", "true", "--orchestrator.curriculum.revisit_hard", "1.0"],
    "curriculum3": ["--orchestrator.curriculum.enabled", "true", "--orchestrator.curriculum.hard_after", "3"],
    "curriculum4": ["--orchestrator.curriculum.enabled", "true", "--orchestrator.curriculum.hard_after", "4"],
    "curriculum3_r3": ["--orchestrator.curriculum.enabled", "true", "--orchestrator.curriculum.hard_after", "3",
                       "--orchestrator.curriculum.revisit_hard", "0.3"],
}


def plot(results: list[dict], path: Path) -> None:
    """Training-pool accuracy against wall time, a colour per mode: each seed a thin line, the
    mean over seeds (of each run's last evaluation by then, as at_times reads it) a thick one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = dict(zip(MODES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for r in results:
        ax.plot(r["pool_s"], r["pool_accuracy"], color=colours[r["mode"]], alpha=0.25, linewidth=0.8)
    for mode, runs in by_mode(results).items():
        grid = list(range(10, int(min(r["pool_s"][-1] for r in runs)) + 1, 10))
        mean = [sum(accuracy_at(r, t) for r in runs) / len(runs) for t in grid]
        ax.plot(grid, mean, color=colours[mode], linewidth=2.2, label=f"{mode}, mean of {len(runs)} seeds")
    ax.set_xlabel("seconds from the first batch")
    ax.set_ylabel("greedy accuracy on the training pool")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


TIMES = [100, 150, 200, 250, 300, 400]  # seconds from the first batch the tables read accuracy at
LEVELS = [0.50, 0.52, 0.55]  # pool accuracies the tables time


def by_mode(results: list[dict]) -> dict[str, list[dict]]:
    modes: dict[str, list[dict]] = {}
    for r in results:
        modes.setdefault(r["mode"], []).append(r)
    return modes


def accuracy_at(r: dict, t: float) -> float:
    """A run's pool accuracy at `t`: its last evaluation by then (what stopping it there would give;
    a run that already ended keeps its last)."""
    return [a for a, s in zip(r["pool_accuracy"], r["pool_s"]) if s <= t][-1]


def at_times(results: list[dict], times: list[float]) -> None:
    """Pool accuracy each run had at each of `times` (accuracy_at) with the mean over seeds, and the
    other way round, the seconds until it first reached each of a few levels."""
    modes = by_mode(results)

    def reached(r: dict, level: float) -> str:
        t = first_time(r, level)
        return "-" if t is None else str(t)

    rows = []
    for mode, runs in modes.items():
        values = [[accuracy_at(r, t) for r in runs] for t in times]
        rows.append([mode, *(f"{sum(v) / len(v):.3f} ({', '.join(f'{x:.3f}' for x in v)})" for v in values)])
    print_table(["sampling", *(f"pool accuracy at {t:g} s (seeds)" for t in times)], rows)
    print_table(["sampling", *(f"s to pool accuracy {v:.2f} (seeds)" for v in LEVELS)],
                [[mode, *(", ".join(reached(r, v) for r in runs) for v in LEVELS)] for mode, runs in modes.items()])


def first_time(r: dict, level: float) -> float | None:
    """Seconds until a run's pool accuracy first reached `level` (None: never)."""
    return next((s for a, s in zip(r["pool_accuracy"], r["pool_s"]) if a >= level), None)


def paired(results: list[dict], levels: list[float]) -> None:
    """Each mode against uniform sampling seed by seed (the same seed: the same rows, the same
    start): on how many seeds it reached each level sooner (a run that never reached it is the
    slower), and the median of its time over uniform's where both reached it."""
    modes = by_mode(results)
    uniform = {r["seed"]: r for r in modes.pop("uniform", [])}
    never = float("inf")
    rows = []
    for mode, runs in modes.items():
        pairs = [(r, uniform[r["seed"]]) for r in runs if r["seed"] in uniform]
        cells = []
        for level in levels:
            times = [(first_time(a, level), first_time(b, level)) for a, b in pairs]
            sooner = sum((never if a is None else a) < (never if b is None else b) for a, b in times)
            ratios = [a / b for a, b in times if a is not None and b is not None]
            cells.append(f"{sooner} of {len(pairs)}, median ratio {statistics.median(ratios):.2f}" if ratios
                         else f"{sooner} of {len(pairs)}")
        rows.append([mode, *cells])
    print_table(["sampling, against uniform", *(f"sooner to {v:.2f} (seeds), time ratio" for v in levels)], rows)


def replot(results_file: Path, path: Path) -> None:
    """The plot again from a results file, with each run's times read from its metrics."""
    data = json.loads(results_file.read_text())
    tag = f"_beyond{data['args']['rows']}" if data["args"].get("beyond_rows") else ""
    for r in data["runs"]:
        metrics = ROOT / "runs" / "bench" / f"curriculum_{r['mode']}_{r['seed']}{tag}" / "metrics.jsonl"
        r["pool_s"] = pool_times([json.loads(line) for line in metrics.read_text().splitlines()])
    results_file.write_text(json.dumps(data, indent=1) + "\n")
    plot(data["runs"], path)
    at_times(data["runs"], TIMES)
    paired(data["runs"], LEVELS)


def arrows(values: list[float]) -> str:
    return " -> ".join(f"{v:.2f}" for v in values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--target", type=float, default=0.45, help="trailing-20 reward_sampled_mean to time")
    ap.add_argument("--modes", nargs="+", default=["uniform", "curriculum", "easy_only"], choices=list(MODES))
    ap.add_argument("--beyond-rows", type=int, default=0, help="rows beyond reach mixed in (see above)")
    ap.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    ap.add_argument("--budget-s", type=float, help="stop each run this many seconds after launch (a wall "
                    "budget alike for every mode; --steps then only caps it)")
    ap.add_argument("--plot", type=Path, help="also plot pool accuracy against time to this file")
    ap.add_argument("--replot", type=Path, help="only plot (to --plot) from this results file and its runs")
    args = ap.parse_args()
    if args.replot:
        return replot(args.replot, args.plot or ROOT / "docs" / "curriculum_wall_time.png")

    # The demo's config with its training rows cut to --rows (a list entry: no command-line key).
    demo = (ROOT / "configs" / "demo.toml").read_text()
    assert demo.count("size = 10000") == 1
    config = ROOT / "runs" / "bench" / "curriculum_demo.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    # Evaluated on the training pool too (the rows the curriculum chooses among: what it should
    # learn faster) besides the held-out rows; the sampled reward is over the rows each run chose.
    beyond = BEYOND.format(rows=args.beyond_rows) if args.beyond_rows else ""
    # Before the eval tables: a [[...datasets]] entry after them would belong to orchestrator.eval.
    demo = demo.replace("size = 10000", f"size = {args.rows}")
    at = demo.index("[orchestrator.eval]")
    config.write_text(demo[:at] + beyond.lstrip() + "\n" + demo[at:] + POOL_EVAL.format(rows=args.rows))
    results = []
    for seed in args.seeds:
        for mode in args.modes:
            tag = f"_beyond{args.rows}" if args.beyond_rows else ""
            out = ROOT / "runs" / "bench" / f"curriculum_{mode}_{seed}{tag}"
            overrides = ["--max_steps", str(args.steps), "--seed", str(seed), "--orchestrator.eval.rows", "200",
                         "--orchestrator.eval.every", str(args.eval_every),
                         *MODES[mode]]
            wall, records = run_rl(str(config), out, overrides, timeout_s=3600, stop_after_s=args.budget_s)
            row = {"seed": seed, "mode": mode, **summary(wall, records, args.target)}
            print(json.dumps(row), flush=True)
            results.append(row)
    save_results(f"curriculum_{'_'.join(args.modes)}{f'_beyond{args.rows}' if args.beyond_rows else ''}", args, results)
    print_table(["seed", "sampling", "wall s", "groups generated / filtered", "rows skipped",
                 "reward (trailing 20) at the end", f"s to {args.target}", "training-pool accuracy",
                 "held-out accuracy"],
                [[r["seed"], r["mode"], r["wall_s"], f"{r['generated']} / {r['filtered']}", r["skipped"],
                  r["reward_trailing20_end"], r["target_s"], arrows(r["pool_accuracy"]), arrows(r["heldout_accuracy"])]
                 for r in results])
    if args.plot:
        plot(results, args.plot)
    at_times(results, TIMES)
    paired(results, LEVELS)


if __name__ == "__main__":
    main()
