"""Weight deltas by broadcast (`[weight_sync] kind = "broadcast"`, `delta = true`): the trainer's
BroadcastPublisher sends a full version, then only the changed values of each later one (over
gloo); a real vLLM server rebuilds them from the full version it keeps and then serves exactly
what a full reload of the same tensors serves."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from safetensors.torch import save_file

from conftest import TINY_MODEL, free_port
from rl.config import RunConfig
from rl.rundir import STABLE, RunDir
from rl.weights import broadcast as bc
from rl.weights import delta as wd
from weight_versions import detail, greedy, step_tensors, update


pytestmark = pytest.mark.slow


def in_thread(fn, box: dict) -> threading.Thread:
    def go():
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the test
            box["error"] = e

    t = threading.Thread(target=go)
    t.start()
    return t


def test_a_real_server_takes_deltas_by_broadcast_bit_for_bit(tmp_path):
    from programs import launch_server, wait_healthy
    from trainer.publish import BroadcastPublisher

    run = RunDir(tmp_path / "run")
    run.make()
    address = f"127.0.0.1:{free_port()}"
    sync = f'[weight_sync]\nkind = "broadcast"\naddress = "{address}"\ndelta = true\n[timeouts]\nbroadcast_s = 60\n'
    proc, url = launch_server(tmp_path, "server", TINY_MODEL, run.root, extra=sync)
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(run.root),
                                    "inference": {"dtype": "float32"},
                                    "weight_sync": {"kind": "broadcast", "address": address, "delta": True, "full_every": 8},
                                    "timeouts": {"broadcast_s": 60}})
    policy = SimpleNamespace(cfg=cfg, run=run)
    box: dict = {}
    try:
        wait_healthy(proc, url)
        thread = in_thread(lambda: BroadcastPublisher(0, None, cfg, run, tied=True), box)
        r = httpx.post(f"{url}/init_broadcaster", json={"address": address, "rank_offset": 1, "world_size": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
        thread.join()
        assert "error" not in box, box["error"]
        publisher = box.pop("result")
        outputs = {}
        for step in (1, 2, 3):
            thread = in_thread(lambda step=step: publisher.deliver(policy, step, step_tensors(step)), box)
            while not (run.weights_dir(step) / STABLE).exists():  # the orchestrator's cue
                time.sleep(0.01)
            status, text = update(url, run.weights_dir(step), step)
            thread.join()
            assert status == 200 and "error" not in box, (text, box.get("error"))
            outputs[step] = greedy(url)
        files = run.weights / "files"  # version 3 as a full HF directory, reloaded from files
        files.mkdir()
        for f in TINY_MODEL.glob("*.json"):
            (files / f.name).write_bytes(f.read_bytes())
        save_file({k: v for k, v in step_tensors(3).items() if k != "lm_head.weight"}, files / "model.safetensors")
        assert update(url, files, 4)[0] == 200
        by_files = greedy(url)
        # A delta against a base the worker does not hold (the trainer's record of its base
        # tampered with): refused with one line, the sender told, the server on version 4.
        held = publisher.versions.base_digest
        publisher.versions.base_digest = wd.Digest(held.run_id, held.version, "0" * 16)
        thread = in_thread(lambda: publisher.deliver(policy, 5, step_tensors(5)), box)
        while not (run.weights_dir(5) / STABLE).exists():
            time.sleep(0.01)
        refused = update(url, run.weights_dir(5), 5)
        thread.join()
        sender_error = box.pop("error", None)
        still = greedy(url), httpx.get(f"{url}/health", timeout=10).json()["version"]
        publisher.close()
    finally:
        proc.stop()
    assert refused[0] == 409 and wd.REFUSED in detail(refused[1]), refused
    assert "which this worker does not hold" in refused[1] and "still serves version 4" in refused[1], refused
    assert isinstance(sender_error, bc.BroadcastError) and "failed to load on rank 1" in str(sender_error), sender_error
    assert still == (by_files, 4)
    assert outputs[3] == by_files  # the same tokens and logprobs: the same weights
    assert outputs[2] != outputs[1] and outputs[3] != outputs[2]
    # Only the changed values went over the wire: the bytes the server's worker received (counted
    # from what its collectives filled, in its log) for version 3 against version 1's, which
    # hold every tensor of the model.
    log = proc.log.read_text(errors="replace")
    full = re.search(r"received version 1 by broadcast, checked against its digest, loaded in [\d.]+ s "
                     r"\(checksum ([0-9a-f]{16}), (\d+) bytes received\)", log)
    delta = re.search(r"version 3 rebuilt from version 1 \+ \d+ changed values received by broadcast, loaded in "
                      r"[\d.]+ s \(checksum ([0-9a-f]{16}), (\d+) bytes received\)", log)
    assert full and delta, log[-3000:]
    tensors = {k: v for k, v in step_tensors(1).items() if k != "lm_head.weight"}
    assert full.group(1) == wd.checksum(tensors) and int(full.group(2)) >= sum(t.nbytes for t in tensors.values())
    assert delta.group(1) == wd.checksum({k: v for k, v in step_tensors(3).items() if k != "lm_head.weight"})
    manifest = wd.read_manifest(run.weights_dir(3))
    assert manifest.base_version == 1 and 0 < int(delta.group(2)) < 0.2 * int(full.group(2)), (delta, full)
    assert (run.weights_dir(1) / wd.DIGEST).exists() and not (run.weights_dir(3) / wd.DIGEST).exists()
