"""The three programs' Prometheus metrics in-process: names by Prometheus' conventions, values fed
from each program's own records, the exporter and its file_sd target file, a taken port refused at
start-up, the list in docs/observability.md. tests/integration/test_prometheus_scrape.py scrapes a real run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch
from fastapi import HTTPException

from conftest import ROOT, TINY_MODEL, free_port, rl_command
from prometheus_names import names_in
from rl import prometheus
from rl.config import RunConfig

sys.path.insert(0, str(ROOT / "scripts"))
import metrics_doc  # noqa: E402

# Labels a series may carry of its own; run, rank, host and program come from the target file.
BOUNDED_LABELS = {"outcome", "name", "kind", "code"}


def test_names_follow_prometheus_conventions():
    metrics = metrics_doc.metrics()
    assert len(metrics) > 40
    for program, name, kind, labels, about in metrics:
        assert name.startswith(f"asyncrl_{program}_"), name
        assert not name.endswith("_total"), f"{name}: the client adds _total to counters"
        if kind == "histogram" or "timestamp" in name:
            assert name.endswith("_seconds"), f"{name}: seconds in the name"
        assert set(labels) <= BOUNDED_LABELS, (name, labels)
        assert about.endswith(".") and "|" not in about, about
    assert len({m[1] for m in metrics}) == len(metrics)


def test_names_in_reads_expressions():
    assert names_in('sum without (code) (increase(asyncrl_inference_weight_updates_refused_total[10m])) > 0 '
                    'and up{program!="up"} == 0 or rate(vllm:generation_tokens_total[1m])') == {
        "asyncrl_inference_weight_updates_refused_total", "up", "vllm:generation_tokens_total"}


def sample(registry, metric: str, **labels) -> float | None:
    return registry.get_sample_value(metric, labels)


def test_orchestrator_metrics_follow_the_batch_record():
    from orchestrator import prometheus as p

    before = {k: sample(p.REGISTRY, f"asyncrl_orchestrator_{n}_total") for k, n in
              (("episodes_failed_scored", "episodes_failed"), ("cancelled", "groups_cancelled_off_policy"))}
    record = {"step": 7, "in_flight": 5, "buffered": 2, "reward_mean": 0.25, "reward_sampled_mean": 0.2,
              "staleness_mean": 0.5, "staleness_max": 1, "filtered": 3, "episodes_failed_scored": 2, "requeued": 1, "cancelled": 4,
              "dropped_stale": 0, "failed_requests": 1, "truncated": 6, "samples_scored": 64, "wait_s": 1.5,
              "group_wait_s": 0.5, "weight_update_s": 0.3}
    p.batch_reported(record, model_tokens=1000, handover_s=0.02)
    assert sample(p.REGISTRY, "asyncrl_orchestrator_step") == 7
    assert sample(p.REGISTRY, "asyncrl_orchestrator_reward_mean") == 0.25
    assert sample(p.REGISTRY, "asyncrl_orchestrator_staleness_max_steps") == 1
    assert sample(p.REGISTRY, "asyncrl_orchestrator_episodes_failed_total") == before["episodes_failed_scored"] + 2
    assert sample(p.REGISTRY, "asyncrl_orchestrator_groups_cancelled_off_policy_total") == before["cancelled"] + 4
    assert sample(p.REGISTRY, "asyncrl_orchestrator_handover_seconds_count") >= 1
    assert time.time() - sample(p.REGISTRY, "asyncrl_orchestrator_last_batch_timestamp_seconds") < 60
    p.evaluated({"eval/reverse/reward": 0.75, "eval/reverse/rows": 32, "step": 7})
    assert sample(p.REGISTRY, "asyncrl_orchestrator_eval_score", name="reverse/reward") == 0.75
    assert sample(p.REGISTRY, "asyncrl_orchestrator_eval_score", name="reverse/rows") is None


def test_sandbox_runs_are_counted_by_outcome():
    from orchestrator import prometheus as p
    from orchestrator.sandbox.sandbox import Limits, Sandbox

    from orchestrator.sandbox.sandbox import OUTCOME_LISTENERS

    before = sample(p.REGISTRY, "asyncrl_orchestrator_sandbox_runs_total", outcome="error") or 0
    OUTCOME_LISTENERS.append(p.sandbox_run)  # as orchestrator/main.py does
    try:
        result = __import__("asyncio").run(Sandbox(Limits(), "none").run("raise SystemExit(3)"))
    finally:
        OUTCOME_LISTENERS.remove(p.sandbox_run)
    assert result.outcome == "error"
    assert sample(p.REGISTRY, "asyncrl_orchestrator_sandbox_runs_total", outcome="error") == before + 1


def config(tmp_path, **trainer) -> RunConfig:
    return RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path / "run"), "trainer": trainer})


def test_trainer_serves_its_step_and_writes_its_target(tmp_path, monkeypatch):
    from trainer.metrics import TrainerMetrics

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = free_port()
    metrics = TrainerMetrics(config(tmp_path, metrics_port=port, mismatch={"kl_warn": 0.02}), 3, torch.device("cpu"))
    target = tmp_path / "run" / "prometheus" / f"trainer-127.0.0.1-{port}.json"
    assert json.loads(target.read_text()) == [{"targets": [f"127.0.0.1:{port}"], "labels": {
        "program": "trainer", "host": "127.0.0.1", "run": "run", "rank": "3"}}]
    record = {"step": 4, "loss": -0.5, "grad_norm": 1.25, "entropy": 2.0, "mismatch_kl": 1e-3,
              "trainer_tokens_per_s": 900.0, "tokens": 300, "step_s": 0.33, "write_s": 0.1, "wait_s": 2.0}
    metrics.step(record, torch.nn.Linear(4, 4), "float32")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert "asyncrl_trainer_step 4.0" in text and "asyncrl_trainer_loss -0.5" in text
    assert "asyncrl_trainer_tokens_total 300.0" in text and "asyncrl_trainer_mismatch_kl_bound 0.02" in text
    assert "asyncrl_trainer_batch_wait_seconds_count 1.0" in text
    assert "mfu" not in text  # a CPU's peak is not known
    assert float(re.search(r"^asyncrl_trainer_peak_memory_bytes (\S+)$", text, re.M)[1]) > 10 * 2**20


def test_mfu_only_where_the_peak_is_known(monkeypatch):
    from trainer.metrics import peak_flops

    cuda = torch.device("cuda", 0)
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(cuda, "bfloat16") == peak, name
    assert peak_flops(cuda, "float32") is None
    assert peak_flops(torch.device("cpu"), "bfloat16") is None


def test_weight_updates_counted_by_kind_and_refusal(tmp_path):
    import asyncio

    from inference import metrics as m
    from rl.weights import broadcast as bc
    from rl.weights import delta as wd

    def count(name: str, **labels) -> float:
        return sample(m.REGISTRY, f"asyncrl_inference_{name}", **labels) or 0.0

    full, delta, cast = (tmp_path / n for n in ("full", "delta", "cast"))
    for d in (full, delta, cast):
        d.mkdir()
    (delta / wd.MANIFEST).write_text("{}")
    (cast / bc.MANIFEST).write_text("{}")
    before = {k: count("weight_updates_total", kind=k) for k in ("full", "delta", "broadcast")}
    reloads = count("reload_seconds_count")

    async def answer(reload_s: float) -> dict:
        return {"version": 1, "reload_s": reload_s, "switched": 0}

    async def refuse(code: int) -> dict:
        raise HTTPException(code, "no")

    for path in (full, delta, cast, delta):
        asyncio.run(m.timed_update(lambda: answer(0.4), path))
    asyncio.run(m.timed_update(lambda: answer(0.0), full))  # already serving it: no reload
    assert count("weight_updates_total", kind="delta") == before["delta"] + 2
    assert count("weight_updates_total", kind="broadcast") == before["broadcast"] + 1
    assert count("weight_updates_total", kind="full") == before["full"] + 1
    assert count("reload_seconds_count") == reloads + 4
    refused = count("weight_updates_refused_total", code="409")
    failed = count("weight_updates_failed_total", code="504")
    for code in (409, 504):
        with pytest.raises(HTTPException):
            asyncio.run(m.timed_update(lambda code=code: refuse(code), delta))
    assert count("weight_updates_refused_total", code="409") == refused + 1
    assert count("weight_updates_failed_total", code="504") == failed + 1


def test_inference_metrics_join_the_registry_vllm_serves(tmp_path):
    from prometheus_client import REGISTRY

    from inference import metrics as m

    class Generations:
        version, aborted = 5, 2

    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path / "run"),
                                    "inference": {"port": 8123}})
    m.attach(cfg, Generations())
    Generations.version = 6
    m.attach(cfg, Generations())  # a second server in one process: no duplicate registration
    assert REGISTRY.get_sample_value("asyncrl_inference_weight_version") == 6
    assert REGISTRY.get_sample_value("asyncrl_inference_requests_aborted_total") == 2
    target = json.loads((tmp_path / "run" / "prometheus" / "inference-127.0.0.1-8123.json").read_text())
    assert target == [{"targets": ["127.0.0.1:8123"], "labels": {"program": "inference", "host": "127.0.0.1",
                                                                 "run": "run"}}]


WRITE_TARGET = ("import sys, time; from rl.prometheus import write_target; "
                "print(write_target(sys.argv[1], 'trainer', '0.0.0.0', 9300, {'run': 'r'}), flush=True); "
                "time.sleep(float(sys.argv[2]))")


def test_target_file_goes_with_a_clean_exit_and_stays_after_a_kill(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", WRITE_TARGET, str(tmp_path / "a"), "0"], capture_output=True,
                          text=True, env=env, timeout=60)
    path = done.stdout.strip()
    assert path.endswith(f"trainer-{socket.getfqdn()}-9300.json") and not os.path.exists(path), done.stderr
    proc = subprocess.Popen([sys.executable, "-c", WRITE_TARGET, str(tmp_path / "b"), "60"], stdout=subprocess.PIPE,
                            text=True, env=env)
    path = proc.stdout.readline().strip()
    assert json.loads(open(path).read())[0]["targets"] == [f"{socket.getfqdn()}:9300"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.exists(path)  # Prometheus keeps scraping it: `up` 0, AsyncrlMetricsGone


@pytest.mark.parametrize("program", ["orchestrator", "trainer"])
def test_a_taken_metrics_port_stops_the_start(tmp_path, program):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # The trainer's local rank 1 takes metrics_port + 1.
        asked, env = (port, {}) if program == "orchestrator" else (port - 1, {"LOCAL_RANK": "1"})
        result = subprocess.run(rl_command(program, "@", str(ROOT / "configs" / "reverse_demo.toml"), "--output_dir",
                                           str(tmp_path / "run"), f"--{program}.metrics_port", str(asked)),
                                capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{program}.metrics_port: cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run" / "prometheus").exists()


def test_docs_list_every_metric():
    doc = metrics_doc.DOC.read_text()
    start, end = doc.index(metrics_doc.BEGIN), doc.index(metrics_doc.END) + len(metrics_doc.END)
    assert doc[start:end] == metrics_doc.table(), "docs/observability.md: run scripts/metrics_doc.py --write"


def test_prefix_is_shared():
    assert all(m[1].startswith(prometheus.PREFIX) for m in metrics_doc.metrics())
