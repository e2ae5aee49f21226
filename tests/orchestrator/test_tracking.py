"""Trackers (orchestrator/reporting/tracking.py) fed from metrics.jsonl: TensorBoard event files that TensorBoard's
own reader reads back, wandb's offline run files, a resumed tracker that neither repeats nor
loses a record and keeps its wandb run, and a failing sink that costs only itself."""

from __future__ import annotations

import logging
import threading
import time

from orchestrator.reporting.tracking import Tracker
from rl.config import RunConfig
from rl.rundir import RunDir, write_file_atomic
from tracker_files import scalars


def config(tmp_path, **tracking) -> RunConfig:
    return RunConfig.model_validate({"model": "m", "output_dir": str(tmp_path / "run"),
                                     "tracking": {"run_name": "t", **tracking}})


def append(run: RunDir, *records) -> None:
    for r in records:
        run.append_metrics(r)


def test_records_reach_tensorboard_and_wandb_and_a_resumed_tracker_goes_on(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # auto mode: offline
    cfg = config(tmp_path, tensorboard=True, wandb=True)
    run = RunDir(cfg.run_dir)
    run.make()
    append(run, {"program": "eval", "step": 0, "version": 0, "eval/d/accuracy": 0.25},
           {"program": "trainer", "step": 1, "loss": 0.5, "grad_norm": 2.0},  # may come before the orchestrator's
           {"program": "orchestrator", "step": 1, "reward_mean": 0.125, "staleness_hist": {"0": 64},
            "filtered": 3})
    tracker = Tracker(cfg)
    assert set(tracker.sinks) == {"tensorboard", "wandb"}
    assert tracker.forward() == 3
    tracker.close()

    # A restarted orchestrator: only the records after the first tracker's go out, to the same wandb run.
    append(run, {"program": "orchestrator", "step": 2, "reward_mean": 0.375})
    again = Tracker(cfg)
    assert again.forward() == 1
    again.close()

    tb = scalars(run.root / "tracking" / "tensorboard")
    assert tb["orchestrator/reward_mean"] == [(1, 0.125), (2, 0.375)]
    assert tb["trainer/loss"] == [(1, 0.5)] and tb["eval/d/accuracy"] == [(0, 0.25)]
    assert tb["orchestrator/filtered"] == [(1, 3.0)]
    assert not any("staleness_hist" in tag or tag.endswith("/time") for tag in tb)  # a dict; the wall clock
    # wandb wrote its offline run (0.31's run file is read by its Go core alone: `wandb sync`), under
    # one id for both trackers: the resumed run continues the same wandb run.
    run_id = (run.root / "tracking" / "wandb_id").read_text()
    files = list((run.root / "tracking" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files and {f.name for f in files} == {f"run-{run_id}.wandb"} and all(f.stat().st_size > 0 for f in files)


class Broken:
    def __init__(self):
        self.calls = 0

    def log(self, step, values):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        pass


def test_a_failing_sink_is_dropped_with_one_warning_and_the_others_go_on(tmp_path, caplog):
    cfg = config(tmp_path, tensorboard=True)
    run = RunDir(cfg.run_dir)
    run.make()
    tracker = Tracker(cfg)
    broken = tracker.sinks["broken"] = Broken()
    append(run, *({"program": "orchestrator", "step": s, "reward_mean": s / 10} for s in (1, 2, 3)))
    with caplog.at_level(logging.WARNING, "tracking"):
        assert tracker.forward() == 3
    tracker.close()
    assert broken.calls == 1 and caplog.text.count("broken failed (OSError: disk full)") == 1
    assert [s for s, _ in scalars(run.root / "tracking" / "tensorboard")["orchestrator/reward_mean"]] == [1, 2, 3]


class Slow:
    """A sink that takes its time, so that calls from two threads overlap inside forward()."""

    def __init__(self):
        self.steps = []

    def log(self, step, values):
        time.sleep(0.001)
        self.steps.append(step)

    def close(self):
        pass


def test_forward_and_close_from_several_threads_send_each_record_once(tmp_path):
    # The orchestrator forwards from a worker thread every 2 s and closes from another at the end
    # (a fresh clone's CI once lost the run to the two renaming the same offset file).
    cfg = config(tmp_path, tensorboard=True)
    run = RunDir(cfg.run_dir)
    run.make()
    tracker = Tracker(cfg)
    slow = tracker.sinks["slow"] = Slow()
    append(run, *({"program": "orchestrator", "step": s, "reward_mean": s / 10} for s in range(1, 41)))
    start = threading.Barrier(4)

    def call(method):
        start.wait()
        method()

    threads = [threading.Thread(target=call, args=(m,)) for m in (tracker.forward,) * 3 + (tracker.close,)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(slow.steps) == list(range(1, 41))
    assert int((run.root / "tracking" / "offset").read_text()) == run.metrics.stat().st_size


def test_atomic_writes_of_one_file_from_several_threads_all_land(tmp_path):
    path = tmp_path / "offset"
    start = threading.Barrier(4)

    def write(n):
        start.wait()
        for i in range(50):
            write_file_atomic(path, f"{n}:{i}".encode())

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in {f"{n}:49" for n in range(4)}
    assert [p.name for p in tmp_path.iterdir()] == ["offset"]  # no temporary left behind
