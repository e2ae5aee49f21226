"""`rl plot <output_dir>`: the PNGs a person reads a run by, drawn from metrics.jsonl (and, for a
multi-run LoRA trainer's directory, each run's own). `rl run` writes them when a run ends.

    reward_curve.png   batch mean reward (and its trailing mean), every sample's, held-out evaluation points
    staleness.png      mean and max staleness of each batch
    throughput.png     tokens/s of generation and training; idle share of the servers and the trainer
    weight_updates.png seconds from a version's discovery to serving it; the trainer's publish time
    runs.png           multi-run: one reward curve per run
    routing.png        mixture-of-experts models recording their routing: the trainer's agreement with
                       the engine's experts per MoE layer, and the share of trained tokens replayed
    loss_curve.png     rl sft: training loss (and its trailing mean), held-out loss per evaluation, and
                       with sft.eval_generate held-out accuracy by generation (right axis)
"""

from __future__ import annotations

import json
from pathlib import Path

WINDOW = 5


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line being written when read
    return records


def series(records: list[dict], program: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted((r["step"], r[key]) for r in records
                    if r.get("program") == program and isinstance(r.get(key), (int, float)))
    return [s for s, _ in points], [v for _, v in points]


def trailing(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1):i + 1]) / len(values[max(0, i - WINDOW + 1):i + 1])
            for i in range(len(values))]


def _figure(title: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    return plt, fig, ax


def _save(plt, fig, ax, path: Path, loc: str = "best") -> Path:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc=loc)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def reward_plot(records: list[dict], out: Path) -> Path:
    plt, fig, ax = _figure("reward", "reward / accuracy")
    steps, rewards = series(records, "orchestrator", "reward_mean")
    ax.plot(steps, rewards, lw=0.8, alpha=0.6, label="batch mean reward")
    ax.plot(steps, trailing(rewards), label=f"trailing {WINDOW}-step mean")
    # With zero-variance filtering the batch holds only the groups kept: the policy's own reward
    # is the mean over every sample scored.
    steps_all, sampled = series(records, "orchestrator", "reward_sampled_mean")
    if sampled:
        ax.plot(steps_all, trailing(sampled), label=f"all samples, trailing {WINDOW}-step mean")
    evals = [r for r in records if r.get("program") == "eval"]
    # Rewards and accuracies only: an environment's evaluation also counts tokens, turns and tool
    # calls per episode, on scales of their own (175 tokens flattened every curve of the tools demo).
    for key in sorted({k for r in evals for k in r if k.startswith("eval/") and _is_score(k)}):
        xs, ys = series(evals, "eval", key)
        ax.plot(xs, ys, "o-", label=f"held-out {key[5:]}")
    return _save(plt, fig, ax, out / "reward_curve.png")


def _is_score(key: str) -> bool:
    last = key.rsplit("/", 1)[-1]
    return last in ("reward", "accuracy") or last.startswith("pass@")


def staleness_plot(records: list[dict], out: Path) -> Path:
    plt, fig, ax = _figure("staleness of the batches", "policy versions behind")
    for key in ("staleness_mean", "staleness_max"):
        ax.plot(*series(records, "orchestrator", key), label=key.replace("_", " "))
    return _save(plt, fig, ax, out / "staleness.png")


def throughput_plot(records: list[dict], out: Path) -> Path:
    plt, fig, ax = _figure("throughput and idle time", "tokens/s")
    steps, gen = series(records, "orchestrator", "tokens_per_s")
    ax.plot(steps, trailing(gen), label="generated tokens/s (inference)")
    steps_t, train = series(records, "trainer", "trainer_tokens_per_s")
    ax.plot(steps_t, trailing(train), label="trained tokens/s (trainer)")
    idle = ax.twinx()
    idle.set_ylabel("idle share")
    idle.set_ylim(0, 1)
    xs, ys = series(records, "orchestrator", "inference_idle_frac")
    idle.plot(xs, trailing(ys), "--", color="tab:green", label="inference idle")
    trainer = sorted((r["step"], r["wait_s"] / max(r["wait_s"] + r["step_s"], 1e-9)) for r in records
                     if r.get("program") == "trainer" and "wait_s" in r and "step_s" in r)
    idle.plot([s for s, _ in trainer], trailing([v for _, v in trainer]), "--", color="tab:red",
              label="trainer waiting")
    idle.legend(fontsize=8, loc="upper right")
    return _save(plt, fig, ax, out / "throughput.png", loc="upper left")


def weight_update_plot(records: list[dict], out: Path) -> Path:
    plt, fig, ax = _figure("weight updates", "seconds")
    ax.plot(*series(records, "orchestrator", "weight_update_s"), ".", ms=3, label="new version found -> serving")
    ax.plot(*series(records, "trainer", "write_s"), ".", ms=3, label="trainer publishing a version")
    return _save(plt, fig, ax, out / "weight_updates.png")


def routing_plot(records: list[dict], out: Path) -> Path:
    plt, fig, ax = _figure("MoE routing: trainer vs engine", "share of positions")
    layers = sorted({k for r in records if r.get("program") == "trainer" for k in r
                     if k.startswith("routing_agreement/layer_")}, key=lambda k: int(k.rsplit("_", 1)[1]))
    for key in layers:
        steps, ys = series(records, "trainer", key)
        ax.plot(steps, trailing(ys), lw=1, label=f"same experts, {key.rsplit('/', 1)[1].replace('_', ' ')}")
    ax.plot(*series(records, "trainer", "routing_replayed_frac"), "--", color="black", lw=1,
            label="trained tokens replayed")
    return _save(plt, fig, ax, out / "routing.png", loc="lower right")


def loss_plot(records: list[dict], out: Path) -> Path:
    plt, fig, ax = _figure("supervised loss", "mean NLL per assistant token")
    steps, nll = series(records, "trainer", "nll")
    label = "batch"
    if not nll:  # sft.label_smoothing: the training loss is the smoothed one
        (steps, nll), label = series(records, "trainer", "smoothed_loss"), "batch (label-smoothed)"
    ax.plot(steps, nll, lw=0.8, alpha=0.6, label=label)
    ax.plot(steps, trailing(nll), label=f"trailing {WINDOW}-step mean")
    ax.plot(*series(records, "eval", "eval/loss"), "o-", label="held-out")
    evals = [r for r in records if r.get("program") == "eval"]
    accuracies = sorted({k for r in evals for k in r if k.startswith("eval/") and k.endswith("/accuracy")})
    if accuracies:  # sft.eval_generate: accuracy by generation on its own axis, beside the loss
        right = ax.twinx()
        right.set_ylabel("held-out accuracy (generation)")
        for key, colour in zip(accuracies, ("tab:red", "tab:purple", "tab:brown", "tab:pink")):
            right.plot(*series(evals, "eval", key), "s--", color=colour, label=key.removeprefix("eval/"))
        right.legend(fontsize=8, loc="center right")
    return _save(plt, fig, ax, out / "loss_curve.png")


def runs_plot(root: Path, out: Path) -> Path | None:
    runs = sorted(p for p in (root / "runs").glob("*/metrics.jsonl"))
    if not runs:
        return None
    plt, fig, ax = _figure("runs sharing the trainer", "batch mean reward (trailing mean)")
    for path in runs:
        steps, rewards = series(read_metrics(path), "orchestrator", "reward_mean")
        ax.plot(steps, trailing(rewards), label=path.parent.name)
    return _save(plt, fig, ax, out / "runs.png")


def write_plots(root: Path) -> list[Path]:
    """Every plot the run's records allow, written into `root`."""
    records = read_metrics(root / "metrics.jsonl")
    written = []
    if any(r.get("program") == "orchestrator" for r in records):
        written += [reward_plot(records, root), staleness_plot(records, root), throughput_plot(records, root),
                    weight_update_plot(records, root)]
    if any(r.get("program") == "trainer" and ("nll" in r or "smoothed_loss" in r) for r in records):
        written.append(loss_plot(records, root))
    if any(r.get("program") == "trainer" and "routing_agreement" in r for r in records):
        written.append(routing_plot(records, root))
    if (multi := runs_plot(root, root)) is not None:
        written.append(multi)
    return written
