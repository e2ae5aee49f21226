"""The figures of docs/performance.md, from the JSON the benchmarks wrote.

    .venv/bin/python benchmarks/plots.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def trailing(curve: list[dict], n: int = 10) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i in range(n - 1, len(curve)):
        xs.append(curve[i]["time"])
        ys.append(sum(r["reward"] for r in curve[i - n + 1:i + 1]) / n)
    return xs, ys


def async_vs_sync(r: dict) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    levels = list(r["runs"])
    names = [f"max_async_level {lv}" for lv in levels]
    a.bar(names, [r["runs"][lv][0]["steps_per_s"] for lv in levels], color=["tab:blue", "tab:gray"])
    a.set_ylabel("trainer steps/s")
    a.set_title(f"{r['config']}: {r['speedup'][0]:.2f}x")
    width = 0.35
    xs = range(len(levels))
    b.bar([x - width / 2 for x in xs], [r["runs"][lv][0]["trainer_idle_frac"] for lv in levels], width, label="trainer")
    b.bar([x + width / 2 for x in xs], [r["runs"][lv][0]["inference_idle_frac"] for lv in levels], width,
          label="inference")
    b.set_xticks(list(xs), names)
    b.set_ylabel("idle fraction")
    b.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "performance_async_vs_sync.png", dpi=110)


def reward_race(r: dict) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for key, label in (("ours", "asyncrl"), ("trl", "TRL GRPOTrainer")):
        ax.plot(*trailing(r[key]["curve"]), label=label)
    ax.axhline(r["target"], color="gray", linestyle=":", label=f"target {r['target']}")
    ax.set_xlabel("seconds from launch")
    ax.set_ylabel("trailing-10 mean reward")
    ax.set_title(f"reversal task, {r['steps']} steps each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "performance_vs_trl_reward.png", dpi=110)


def race(recipe: str, r: dict) -> None:
    """benchmarks/vs_trl.py race: both sides' trailing-10 reward against seconds from launch, per seed."""
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, (seed, row) in enumerate(sorted(r["seeds"].items())):
        style = ("-", "--", ":", "-.")[i % 4]
        for key, label, color in (("ours", "asyncrl", "C0"), ("trl", "TRL GRPOTrainer", "C1")):
            ax.plot(*trailing(row[key]["curve"]), style, color=color, label=f"{label}, seed {seed}")
    ax.axvline(r["budget_s"], color="gray", linestyle=":", linewidth=0.8)
    ax.set_xlabel("seconds from launch")
    ax.set_ylabel("trailing-10 mean reward (all samples)")
    ax.set_title(f"{recipe}: asyncrl against TRL, same model, task and batch")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS / f"performance_vs_trl_{recipe}.png", dpi=110)


def weight_updates(results: dict[str, dict]) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    shapes = list(results)
    width = 0.35
    xs = range(len(shapes))
    ax.bar([x - width / 2 for x in xs], [results[s]["ours_median_s"] for s in shapes], width,
           label="STABLE -> serving (asyncrl)")
    ax.bar([x + width / 2 for x in xs], [results[s]["vllm_median_s"] for s in shapes], width,
           label="vLLM reload_weights")
    ax.set_xticks(list(xs), shapes)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(DOCS / "performance_weight_update.png", dpi=110)


def main() -> None:
    if r := load("async_vs_sync"):
        async_vs_sync(r)
    if r := load("vs_trl_reward"):
        reward_race(r)
    for recipe in ("reverse", "demo", "count"):
        if r := load(f"vs_trl_{recipe}"):
            race(recipe, r)
    updates = {s: r for s in ("tiny", "0.5b") if (r := load(f"weight_update_{s}"))}
    if updates:
        weight_updates(updates)


if __name__ == "__main__":
    main()
