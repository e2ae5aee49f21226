"""trainer.profile_steps: torch.profiler around a window of steps of a real `rl sft` run, its
table, its Chrome trace and its one log line; steps outside the window run unprofiled."""

from __future__ import annotations

import json

from sft_runs import REVERSE, config, sft


def test_a_profiled_window_writes_its_table_trace_and_one_line(tmp_path):
    result = sft(config(tmp_path, REVERSE.replace("eval_every = 10", "eval_every = 0"), steps=5),
                 "--trainer.profile_steps", "[2, 3]")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    lines = [line for line in result.stderr.splitlines() if "profile of steps" in line]
    assert len(lines) == 1 and "profile of steps 2-3 (rank 0)" in lines[0], result.stderr[-3000:]
    assert "CPU busy" in lines[0]  # no GPU here: the CPU's own time is what is measured
    table = (run / "logs" / "profile_rank0.txt").read_text()
    assert table.startswith("steps 2-3, ") and "aten::mm" in table  # the model's matmuls were recorded
    trace = json.loads((run / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names
    # The window's steps, and only they: the optimizer stepped twice inside it.
    steps_in_trace = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("Optimizer.step#")]
    assert len(steps_in_trace) == 2, sorted(names)[:50]
