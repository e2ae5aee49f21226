"""`rl plot` (rl/plots.py): the PNGs of a finished run, from its metrics.jsonl, and one curve per
run for a multi-run directory; a directory that is no run is refused (exit 2)."""

from __future__ import annotations

import subprocess

from PIL import Image

from conftest import rl_command
from rl.rundir import RunDir

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(root, steps: int = 30) -> None:
    run = RunDir(root)
    run.make()
    for s in range(1, steps + 1):
        run.append_metrics({"program": "orchestrator", "step": s, "reward_mean": s / steps, "staleness_mean": 0.5,
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


def test_rl_plot_refuses_a_directory_without_metrics(tmp_path):
    result = subprocess.run(rl_command("plot", str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "holds no metrics.jsonl" in result.stderr
