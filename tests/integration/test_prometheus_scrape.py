"""A real Prometheus (Debian's package, `make install`) scrapes a real `rl run` of the reversal
demo through the file_sd target files the programs write into the run directory, with
deploy/prometheus/asyncrl_rules.yml loaded: every program's series arrive (vLLM's own among the
server's), and once the trainer is killed its target answers no more and AsyncrlMetricsGone's
expression holds for it (the alert goes pending, then would fire after its `for:`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import ROOT, free_port, rl_command
from prometheus_names import expressions


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("prometheus") is None,
                                 reason="prometheus missing: make install (apt-get install prometheus)")]

RULES = ROOT / "deploy" / "prometheus" / "asyncrl_rules.yml"
# Each program's series that say it works, not merely that it answers: a version served, a batch
# handed over, a step trained, tokens generated (vLLM's own counter).
ARRIVED = {
    "inference": ("asyncrl_inference_weight_version > 0", "vllm:generation_tokens_total > 0",
                  'asyncrl_inference_weight_updates_total{kind="full"} > 0'),
    "orchestrator": ("asyncrl_orchestrator_step > 0", "asyncrl_orchestrator_servers_in_rotation == 1",
                     "asyncrl_orchestrator_request_seconds_count > 0", "asyncrl_orchestrator_run_dir_free_bytes > 0"),
    "trainer": ("asyncrl_trainer_step > 0", "asyncrl_trainer_loss", "asyncrl_trainer_publish_seconds_count > 0"),
}
WITHIN_S = 300  # a loaded 2-core machine: engine start, first batches


def prometheus_config(tmp: Path, run: Path) -> Path:
    """The config docs/observability.md gives, with one-second intervals."""
    text = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    text = (text.replace("scrape_interval: 15s", "scrape_interval: 1s")
            .replace("evaluation_interval: 15s", "evaluation_interval: 1s")
            .replace("refresh_interval: 30s", "refresh_interval: 1s")
            .replace("/path/to/asyncrl/deploy/prometheus/asyncrl_rules.yml", str(RULES))
            .replace("/path/to/output_dir", str(run)))
    assert str(RULES) in text and str(run) in text, text
    path = tmp / "prometheus.yml"
    path.write_text(text)
    return path


def query(url: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def wait_for(what: str, check, procs: dict[str, subprocess.Popen], logs: Path, timeout: float = WITHIN_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{tail(logs / f'{name}.log')}"
        try:
            if result := check():
                return result
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"{what} not within {timeout:.0f} s:\n{tail(logs / 'rl-run.log')}\n"
                         f"{tail(logs / 'prometheus.log')}")


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else f"({path} missing)"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_prometheus_scrapes_a_run_and_sees_the_killed_trainer(tmp_path):
    run = tmp_path / "run"
    prom_url = f"http://127.0.0.1:{(prom_port := free_port())}"
    ports = {"inference": free_port(), "orchestrator": free_port(), "trainer": free_port()}
    with open(tmp_path / "rl-run.log", "wb") as out:
        launcher = subprocess.Popen(
            rl_command("run", "@", str(ROOT / "configs" / "reverse_demo.toml"), "--output_dir", str(run),
                       "--max_steps", "5000", "--inference.port", str(ports["inference"]),
                       "--orchestrator.metrics_port", str(ports["orchestrator"]),
                       "--trainer.metrics_port", str(ports["trainer"])),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs = {"rl-run": launcher}
    try:
        config = prometheus_config(tmp_path, run)
        check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(tmp_path / "prometheus.log", "wb") as out:
            procs["prometheus"] = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        targets = run / "prometheus"
        wait_for("every program's target file", lambda: sorted(p.name.split("-")[0] for p in targets.glob("*.json"))
                 == ["inference", "orchestrator", "trainer"], procs, tmp_path)
        for program, exprs in ARRIVED.items():
            for expr in exprs:
                found = wait_for(f"{program}: {expr}", lambda expr=expr: query(prom_url, expr), procs, tmp_path)
                labels = found[0]["metric"]
                assert labels["program"] == program and labels["run"] == "run" and labels["job"] == "asyncrl", labels
        assert query(prom_url, 'up{job="asyncrl"} == 1') and not query(prom_url, 'up{job="asyncrl"} == 0')
        # Every dashboard query and every rule is valid PromQL to this Prometheus (query() asserts success).
        for expr in expressions():
            query(prom_url, expr.replace("$run", ".*"))
        for rule in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]:
            query(prom_url, rule["expr"])

        # Kill the trainer (its heartbeat names its pid): its target file stays, its address stops answering.
        pid = int((run / "heartbeats" / "trainer").read_text().split("@", 1)[0])
        os.kill(pid, signal.SIGKILL)
        del procs["rl-run"]  # fail-fast: it stops the rest now
        gone = next(r for r in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
                    if r["alert"] == "AsyncrlMetricsGone")
        found = wait_for("the killed trainer in AsyncrlMetricsGone's expression", lambda: [
            r for r in query(prom_url, gone["expr"]) if r["metric"]["program"] == "trainer"], procs, tmp_path, 60)
        assert found[0]["metric"]["instance"] == f"127.0.0.1:{ports['trainer']}", found
        assert (targets / f"trainer-127.0.0.1-{ports['trainer']}.json").exists()

        def trainer_alert() -> list[dict]:
            alerts = httpx.get(f"{prom_url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "AsyncrlMetricsGone"
                    and a["labels"]["program"] == "trainer" and a["state"] in ("pending", "firing")]

        alert = wait_for("AsyncrlMetricsGone pending for the trainer", trainer_alert, procs, tmp_path, 60)
        assert alert[0]["labels"]["rank"] == "0", alert
    finally:
        for proc in (launcher, *procs.values()):
            stop(proc)
