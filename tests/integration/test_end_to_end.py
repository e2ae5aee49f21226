"""Real vLLM, the real trainer and the real orchestrator, started as separate programs the way a
user starts them in three terminals, for 3 steps."""

from __future__ import annotations

import httpx
import pytest

from conftest import TINY_MODEL, free_port
from programs import start_server, train
from rl.batch import Batch
from rl.rundir import RunDir

pytestmark = pytest.mark.slow

MAX_ASYNC = 1
PROMPTS = ["abcdefg=", "hello=", "xyzzy=", "reverse="]


def greedy(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "logprobs": 0, "return_token_ids": True})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append((c["token_ids"], c["logprobs"]["token_logprobs"]))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    run = RunDir(tmp / "run")
    server, url = start_server(tmp, "server", TINY_MODEL, run.root)
    try:
        before = greedy(url, str(TINY_MODEL))
        port = url.rsplit(":", 1)[1]
        cfg = tmp / "run.toml"
        cfg.write_text(
            f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 3\nseq_len = 64\n'
            f"max_async_level = {MAX_ASYNC}\n"
            f'[inference]\nport = {port}\ndtype = "float32"\n'
            "[orchestrator]\nscheduling.prompts_per_step = 4\nscheduling.group_size = 4\nscheduling.max_in_flight_groups = 8\n"
            "sampling.max_tokens = 12\n"
            "[trainer]\nfiles.keep_weights = 5\nfiles.keep_rollouts = 5\ntorch_threads = 1\n"
            "[trainer.optim]\nlr = 1e-3\n")
        train(cfg, tmp)
        health = httpx.get(f"{url}/health", timeout=10).json()
        after = greedy(url, str(TINY_MODEL))
        yield {"run": run, "health": health, "before": before, "after": after, "url": url}
    finally:
        server.stop()


def test_three_programs_train_three_steps(trained):
    run: RunDir = trained["run"]
    for n in (1, 2, 3):
        assert (run.weights_dir(n) / "STABLE").exists()
    # The server serves the final version, and its outputs changed with it.
    assert trained["health"]["version"] == 3
    assert trained["health"]["path"] == str(run.weights_dir(3).resolve())
    assert trained["after"] != trained["before"]
    # Every sample of batch n was generated within the async bound.
    for n in (1, 2, 3):
        batch = Batch.read(run.rollout_dir(n))
        assert batch.num_samples == 16
        assert batch.versions.min() >= n - 1 - MAX_ASYNC
        assert batch.versions.max() <= n - 1


def test_reloaded_server_matches_a_fresh_server_on_the_same_weights(trained):
    """After three reloads the server reloads the model it started with ("base"), and answers
    bit for bit as it did freshly loaded, before the run. The tiny model ties lm_head to the
    embedding: without re-packing the lm_head after a reload, vLLM's CPU backend keeps computing
    logits with the old embedding. (One server, its fresh load its own start: the GPU check's
    reload item, tests/integration/test_gpu_check.py, compares a reload of trainer-written files the same way.)"""
    url = trained["url"]
    r = httpx.post(f"{url}/update_weights", json={"path": "base", "version": 4}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health", timeout=10).json()["version"] == 4
    assert greedy(url, str(TINY_MODEL)) == trained["before"]


def test_three_programs_train_with_weights_broadcast_instead_of_files(tmp_path):
    """[weight_sync] kind = "broadcast" through the real programs: the trainer hosts the group,
    the orchestrator joins the server's worker to it, and every version reaches vLLM over gloo."""
    run = RunDir(tmp_path / "run")
    sync = f'[weight_sync]\nkind = "broadcast"\naddress = "127.0.0.1:{free_port()}"\n[timeouts]\nbroadcast_s = 120\n'
    server, url = start_server(tmp_path, "server", TINY_MODEL, run.root, extra=sync)
    try:
        before = greedy(url, str(TINY_MODEL))
        cfg = tmp_path / "run.toml"
        cfg.write_text(
            f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 3\nseq_len = 64\n'
            f'[inference]\nport = {url.rsplit(":", 1)[1]}\ndtype = "float32"\n' + sync +
            "[orchestrator]\nscheduling.prompts_per_step = 4\nscheduling.group_size = 4\nscheduling.max_in_flight_groups = 8\n"
            "sampling.max_tokens = 12\n"
            "[trainer]\ntorch_threads = 1\n[trainer.optim]\nlr = 1e-3\n")
        trainer = train(cfg, tmp_path)
        health = httpx.get(f"{url}/health", timeout=10).json()
        after = greedy(url, str(TINY_MODEL))
    finally:
        server.stop()
    assert health["version"] == 3
    assert after != before
    for n in (1, 2, 3):
        files = {p.name for p in run.weights_dir(n).iterdir()}
        assert {"broadcast.json", "STABLE", "DELIVERED"} <= files, files
        assert not any(f.endswith(".safetensors") for f in files)
    assert "inference worker(s) joined" in trainer.log.read_text()
