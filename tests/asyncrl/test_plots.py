"""`rl plot` (asyncrl/plots.py): the PNGs of a finished run, from its metrics.jsonl, and one curve per
run for a multi-run directory; a directory that is no run is refused (exit 2)."""

from __future__ import annotations

import subprocess

from PIL import Image

from conftest import rl_command
from asyncrl import plots
from rl.rundir import RunDir

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(root, steps: int = 30, scale: float = 1.0) -> None:
    run = RunDir(root)
    run.make()
    for s in range(1, steps + 1):
        run.append_metrics({"program": "orchestrator", "step": s, "reward_mean": scale * s / steps, "staleness_mean": 0.5,
                            "staleness_max": 1, "tokens_per_s": 1000.0 + s, "inference_idle_frac": 0.2,
                            "weight_update_s": 0.05})
        run.append_metrics({"program": "trainer", "step": s, "loss": 0.1, "wait_s": 0.1, "step_s": 0.3,
                            "trainer_tokens_per_s": 5000.0, "write_s": 0.02})
    for s in (0, steps):
        run.append_metrics({"program": "eval", "step": s, "version": s, "eval/d/accuracy": s / steps / 2,
                            "eval/d/rows": 10})


def test_rl_plot_writes_the_runs_pngs(tmp_path):
    fake_run(tmp_path / "run")
    for name in ("a", "b"):
        fake_run(tmp_path / "run" / "runs" / name)
    result = subprocess.run(rl_command("plot", str(tmp_path / "run")), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names = sorted(p.rsplit("/", 1)[1] for p in result.stdout.split())
    assert names == ["reward_curve.png", "runs.png", "staleness.png", "throughput.png", "weight_updates.png"]
    for name in names:
        path = tmp_path / "run" / name
        assert path.read_bytes().startswith(PNG)
        with Image.open(path) as image:
            assert image.size == (650, 360)
            # Something was drawn: far more than the white page and the axes' few colours.
            assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 20


def test_the_runs_plot_draws_one_curve_per_run_from_its_own_metrics(tmp_path, monkeypatch):
    """runs.png of a multi-run directory: exactly one line per run under runs/, labelled with
    its name, whose points are that run's steps and the trailing mean of its own reward_mean
    (the runs' rewards differ, so a curve drawn from another run's records, or twice, shows).
    The lines are read off the figure as it is saved."""
    fake_run(tmp_path / "run")
    scales = {"a": 1.0, "b": 0.25, "c": 0.5}
    for name, scale in scales.items():
        fake_run(tmp_path / "run" / "runs" / name, steps=10 + int(4 * scale), scale=scale)
    drawn = {}
    save = plots._save

    def recording_save(plt, fig, ax, path, loc="best"):
        drawn[path.name] = [(line.get_label(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines]
        return save(plt, fig, ax, path, loc)

    monkeypatch.setattr(plots, "_save", recording_save)
    written = plots.write_plots(tmp_path / "run")
    assert tmp_path / "run" / "runs.png" in written
    lines = drawn["runs.png"]
    assert [label for label, _, _ in lines] == sorted(scales)
    for label, xs, ys in lines:
        steps = 10 + int(4 * scales[label])
        rewards = [scales[label] * s / steps for s in range(1, steps + 1)]
        assert xs == list(range(1, steps + 1))
        assert ys == plots.trailing(rewards)
    # The top-level run's own reward curve is its records, not the runs'.
    label, xs, ys = drawn["reward_curve.png"][0]
    assert label == "batch mean reward" and xs == list(range(1, 31)) and ys == [s / 30 for s in range(1, 31)]


def test_rl_plot_refuses_a_directory_without_metrics(tmp_path):
    result = subprocess.run(rl_command("plot", str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "holds no metrics.jsonl" in result.stderr


def test_the_reward_plot_draws_an_environments_scores_not_its_counts():
    """An environment's evaluation also logs tokens, turns and tool calls per episode (175 tokens
    flattened every curve of the tools demo): the reward axis takes rewards, accuracies, pass@k."""
    keys = ["eval/heldout/reward", "eval/heldout/accuracy", "eval/heldout/pass@4", "eval/heldout/tokens",
            "eval/heldout/turns", "eval/heldout/tool_calls", "eval/heldout/tool_errors", "eval/heldout/failed",
            "eval/heldout/rows"]
    assert [k for k in keys if plots._is_score(k)] == keys[:3]


def test_a_run_that_records_moe_routing_gets_the_routing_plot_with_a_curve_per_layer(tmp_path):
    fake_run(tmp_path)
    run = RunDir(tmp_path)
    for s in range(1, 31):
        run.append_metrics({"program": "trainer", "step": s, "routing_agreement": 0.9, "routing_replayed_frac": 1.0,
                            **{f"routing_agreement/layer_{i}": 0.9 + 0.01 * i for i in range(3)}})
    written = plots.write_plots(tmp_path)
    assert tmp_path / "routing.png" in written
    assert (tmp_path / "routing.png").read_bytes().startswith(PNG)
    fake_run(tmp_path / "dense")
    assert not any(p.name == "routing.png" for p in plots.write_plots(tmp_path / "dense"))
