"""Weight deltas through files (`[weight_sync] delta = true`; rl/weights/delta.py, trainer/deltas.py,
inference/delta_reload.py DeltaFiles, staging.py delta_files).

- The format: encode + rebuild give back every bit (bf16 and float32, -0.0 and NaN included).
- The trainer's FilePublisher writes a full version, then deltas against it, a full one again
  every full_every versions; keep_weights keeps every base a kept delta needs; a trainer killed
  while writing a delta leaves nothing a server would load.
- One real vLLM server (CPU) takes a chain of deltas: it then serves exactly what a full reload
  of the same version serves (greedy tokens and logprobs, and the checksum the server computed
  of the tensors it rebuilt is the full file's); a server holding another base catches up
  through the base's files; a delta whose base is missing, damaged, another run's, other bytes
  than its digest names or without a readable digest, or whose values were tampered with, is
  refused with one line, and the server goes on serving its version. A server with
  weight_sync.delta = false refuses a delta before the update lock.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, TINY_MODEL
from rl.config import RunConfig
from rl.rundir import STABLE, RunDir
from rl.weights import delta as wd
from weight_versions import EMBED, detail, greedy, publisher, serving, step_tensors, update


# --- the format -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encode_then_rebuild_gives_back_every_bit(dtype):
    g = torch.Generator().manual_seed(0)
    base = {"a": torch.randn(64, 33, generator=g).to(dtype), "b": torch.randn(7, generator=g).to(dtype),
            "same": torch.randn(5, generator=g).to(dtype)}
    new = {k: v.clone() for k, v in base.items()}
    new["a"].view(-1)[::17] += 1e-3  # some values move, most do not (bf16 rounds 1e-3 away for many)
    new["b"][0], new["b"][1], new["b"][2] = -0.0, float("nan"), float("inf")
    base["b"][0] = 0.0  # -0.0 == 0.0 as numbers, not as bits
    entries, changes = wd.encode(base, new)
    assert entries["same"].changed == 0 and "same/idx" not in changes
    assert entries["b"].changed == 3
    manifest = wd.Manifest("run", 2, 1, wd.checksum(base), wd.checksum(new), entries)
    assert wd.Manifest.from_json(manifest.to_json()) == manifest
    out = wd.rebuild(base, manifest, changes)
    assert wd.checksum(out) == wd.checksum(new) != wd.checksum(base)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for k in new:
        assert torch.equal(out[k].reshape(-1).view(bits), new[k].reshape(-1).view(bits)), k
    assert out["same"] is base["same"]  # unchanged tensors are not copied
    bad = dict(changes)
    bad["a/idx"] = bad["a/idx"] + 10**6
    with pytest.raises(wd.DeltaRefused, match="indices fall outside"):
        wd.rebuild(base, manifest, bad)
    # In place, for the block only: the base holds the new version inside, its own values after,
    # also when the block raises.
    before = wd.checksum(base)
    with pytest.raises(RuntimeError, match="inside"):
        with wd.patched(base, manifest, changes) as inside:
            assert wd.checksum(inside) == wd.checksum(new)
            raise RuntimeError("inside")
    assert wd.checksum(base) == before
    with pytest.raises(wd.DeltaRefused):
        with wd.patched(base, manifest, bad):
            pass
    assert wd.checksum(base) == before


def test_a_malformed_manifest_is_a_value_error_naming_the_field():
    good = json.loads(wd.Manifest("r", 3, 1, "b", "c", {"x": wd.TensorEntry("float32", (2,), 1)}).to_json())
    for change, match in [({"version": 1}, "not before"), ({"run_id": None}, "must all be set"),
                          ({"tensors": {"x": {"dtype": "float32", "shape": [2], "changed": 3}}}, "outside"),
                          ({"format": "other"}, "not a")]:
        with pytest.raises(ValueError, match=match):
            wd.Manifest.from_json(json.dumps({**good, **change}))


def test_config_delta_needs_full_weights_and_full_every_at_least_one():
    base = {"model": str(TINY_MODEL), "weight_sync": {"delta": True}}
    assert RunConfig.model_validate(base).weight_sync.full_every == 8
    with pytest.raises(ValueError, match="weight_sync.delta applies to full weights"):
        RunConfig.model_validate({**base, "trainer": {"lora": {"rank": 4}}})
    with pytest.raises(ValueError, match="full_every"):
        RunConfig.model_validate({**base, "weight_sync": {"delta": True, "full_every": 0}})


def test_a_bad_full_every_exits_2_with_one_line(tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n[weight_sync]\nfull_every = 0\n')
    out = subprocess.run([sys.executable, "-m", "asyncrl", "trainer", "@", str(cfg), "--dry-run"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out
    assert "weight_sync.full_every" in out.stdout + out.stderr


# --- the trainer's side -----------------------------------------------------------------------


def test_the_publisher_writes_full_then_deltas_and_keeps_their_base(tmp_path):
    run = RunDir(tmp_path / "run")
    run.make()
    pub, policy = publisher(run, full_every=3, keep=2)
    for step in range(1, 8):
        pub.deliver(policy, step, step_tensors(step))
    kinds = {n: "delta" if (run.weights_dir(n) / wd.MANIFEST).exists() else "full" for n in run.weight_steps()}
    # Full at 1, 4, 7 (every 3); keep_weights 2 keeps 6 and 7, and 6's base, 4.
    assert kinds == {4: "full", 6: "delta", 7: "full"}
    manifest = wd.read_manifest(run.weights_dir(6))
    assert (manifest.version, manifest.base_version) == (6, 4)
    digest = wd.Digest.read(run.weights_dir(4))
    assert manifest.base == digest and digest.run_id == (run.weights / wd.RUN_ID).read_text()
    # The delta rebuilds version 6 bit for bit, lm_head left out as from the full file.
    base = load_file(run.weights_dir(4) / "model.safetensors")
    out = wd.rebuild(base, manifest, load_file(run.weights_dir(6) / wd.TENSORS))
    expected = {k: v for k, v in step_tensors(6).items() if k != "lm_head.weight"}
    assert wd.checksum(out) == wd.checksum(expected) == manifest.checksum
    # Small: 3% of the values a step, two steps from the base (index + value: 8 bytes each).
    full_bytes = (run.weights_dir(4) / "model.safetensors").stat().st_size
    assert (run.weights_dir(6) / wd.TENSORS).stat().st_size < 0.2 * full_bytes
    # A restarted trainer (a new publisher) starts with a full version, under the same run id.
    pub2, _ = publisher(run, full_every=3, keep=2)
    pub2.deliver(policy, 8, step_tensors(8))
    assert not (run.weights_dir(8) / wd.MANIFEST).exists() and wd.Digest.read(run.weights_dir(8)).run_id == digest.run_id


KILLED_WRITER = """
import sys
from pathlib import Path
sys.path[:0] = [{here!r}, {tests!r}, {src!r}]
from rl.rundir import RunDir
from weight_versions import publisher, step_tensors
run = RunDir({root!r})
pub, policy = publisher(run)
for step in (1, 2, 3):
    pub.deliver(policy, step, step_tensors(step))
"""


@pytest.mark.slow
def test_a_trainer_killed_while_writing_a_delta_leaves_nothing_loadable(tmp_path):
    run = RunDir(tmp_path / "run")
    run.make()
    script = KILLED_WRITER.format(here=str(Path(__file__).resolve().parent), tests=str(ROOT / "tests"),
                                  src=str(ROOT / "src"), root=str(run.root))
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "ASYNCRL_CRASH_AT": "weights.staged:3"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    # Version 2 (a delta) is published; version 3's files lie aside, without STABLE, under a name
    # no server is ever handed (the orchestrator delivers only weights/step_<n> with STABLE).
    assert run.stable_weight_steps() == [1, 2] and (run.weights_dir(2) / wd.MANIFEST).exists()
    staged = run.weights / ".step_3.tmp"
    assert (staged / wd.TENSORS).exists() and not (staged / STABLE).exists()
    assert not run.weights_dir(3).exists()
    # A resumed trainer publishes version 3 afresh (full: it holds no base), the partial one gone.
    pub, policy = publisher(run)
    pub.deliver(policy, 3, step_tensors(3))
    assert not staged.exists() and (run.weights_dir(3) / STABLE).exists()


# --- one real server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM server with weight_sync.delta = true, and versions written by the trainer's
    FilePublisher: 1 full, 2-4 deltas against it (the chain), 5 the full file of version 4 (no
    digest: vLLM's own reload), 6 another full version with a digest."""
    from programs import launch_server, wait_healthy

    tmp = tmp_path_factory.mktemp("delta")
    run = RunDir(tmp / "run")
    run.make()
    pub, policy = publisher(run, keep=100)
    for step in (1, 2, 3, 4):
        pub.deliver(policy, step, step_tensors(step))
    full4 = run.weights_dir(5)
    shutil.copytree(run.weights_dir(1), full4)
    (full4 / wd.DIGEST).unlink()
    save_file({k: v for k, v in step_tensors(4).items() if k != "lm_head.weight"}, full4 / "model.safetensors")
    pub2, _ = publisher(run, keep=100)  # a restart: its first version is full
    pub2.deliver(policy, 6, step_tensors(9))
    proc, url = launch_server(tmp, "server", TINY_MODEL, run.root, extra="[weight_sync]\ndelta = true\n")
    try:
        wait_healthy(proc, url)
        yield SimpleNamespace(proc=proc, url=url, run=run, tmp=tmp, publisher=pub)
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_chain_of_deltas_serves_exactly_what_a_full_reload_serves(server):
    url, run = server.url, server.run
    assert update(url, run.weights_dir(1), 1)[0] == 200
    v1 = greedy(url)
    chain = []
    for v in (2, 3, 4):
        status, text = update(url, run.weights_dir(v), v)
        assert status == 200, text
        chain.append(greedy(url))
    log = server.proc.log.read_text()
    assert "version 4 rebuilt from version 1 + " in log
    status, text = update(url, run.weights_dir(5), 5)  # the full file of version 4, vLLM's own reload
    assert status == 200, text
    full = greedy(url)
    assert chain[-1] == full  # the same tokens and the same logprobs, to the bit
    assert chain[0] != v1 and chain[-1] != chain[0]
    # The tensors: the checksum the worker computed of what it rebuilt and loaded (its log line)
    # is the full file's.
    rebuilt = re.search(r"version 4 rebuilt from version 1 \+ \d+ changed values in [\d.]+ s, loaded in [\d.]+ s "
                        r"\(checksum ([0-9a-f]{16})\)", log)
    assert rebuilt, log[-3000:]
    assert rebuilt.group(1) == wd.checksum(load_file(run.weights_dir(5) / "model.safetensors"))


@pytest.mark.slow
def test_a_server_holding_another_base_catches_up_through_the_base_files(server):
    """The server holds version 6's tensors as its base; a delta against version 1 (as for a
    server that restarted after version 1 was published) reads version 1's files, checks them,
    and serves exactly the full file's version."""
    url, run = server.url, server.run
    assert update(url, run.weights_dir(6), 6)[0] == 200
    late = run.weights_dir(7)
    shutil.copytree(run.weights_dir(4), late)
    manifest = wd.read_manifest(late)
    (late / wd.MANIFEST).write_bytes(wd.Manifest(manifest.run_id, 7, 1, manifest.base_checksum, manifest.checksum,
                                                 manifest.tensors).to_json())
    status, text = update(url, late, 7)
    assert status == 200, text
    got = greedy(url)
    assert update(url, run.weights_dir(5), 8)[0] == 200
    assert got == greedy(url)


def refused_delta(server, version: int, base: int, run_id: str | None = None) -> Path:
    """weights/step_<version>: version 4's delta renamed, against `base`, of `run_id`."""
    src = server.run.weights_dir(4)
    out = server.run.weights_dir(version)
    shutil.copytree(src, out)
    m = wd.read_manifest(src)
    base_checksum = m.base_checksum
    if (server.run.weights_dir(base) / wd.DIGEST).exists():
        base_checksum = wd.Digest.read(server.run.weights_dir(base)).checksum
    (out / wd.MANIFEST).write_bytes(wd.Manifest(run_id or m.run_id, version, base, base_checksum, m.checksum,
                                                m.tensors).to_json())
    return out


@pytest.mark.slow
def test_faulty_deltas_are_refused_with_one_line_and_the_server_keeps_serving(server):
    url, run = server.url, server.run
    assert update(url, run.weights_dir(4), 4)[0] == 200  # serving version 4, base 1 held
    before = greedy(url)
    answers = {}
    # Missing: its base was never kept.
    answers["missing"] = update(url, refused_delta(server, 20, 19), 20)
    # Another run's: a delta naming run "other", against version 1 of this run.
    answers["other run"] = update(url, refused_delta(server, 21, 1, run_id="other"), 21)
    # Damaged: a base whose file changed after its digest was written (one value's bytes).
    damaged = run.weights_dir(22)
    shutil.copytree(run.weights_dir(1), damaged)
    digest = wd.Digest.read(damaged)
    (damaged / wd.DIGEST).write_bytes(wd.Digest(digest.run_id, 22, digest.checksum).to_json())
    tensors = load_file(damaged / "model.safetensors")
    tensors[EMBED][0, 0] += 1.0
    save_file(tensors, damaged / "model.safetensors")
    answers["damaged"] = update(url, refused_delta(server, 23, 22), 23)
    # Tampered: the base is the one held, but the values do not rebuild the version's checksum.
    tampered = refused_delta(server, 24, 1)
    changes = load_file(tampered / wd.TENSORS)
    key = next(k for k in changes if k.endswith("/val"))
    changes[key] = changes[key] + 1.0
    save_file(changes, tampered / wd.TENSORS)
    answers["tampered"] = update(url, tampered, 24)
    # Other bytes: this run's version 1, but not the bytes its digest names (the base's checksum
    # in the delta is another one).
    other = refused_delta(server, 28, 1)
    m = wd.read_manifest(other)
    (other / wd.MANIFEST).write_bytes(wd.Manifest(m.run_id, 28, 1, "0" * 16, m.checksum, m.tensors).to_json())
    answers["other bytes"] = update(url, other, 28)
    # No readable digest: a base that is a version (STABLE) whose digest.json is not one.
    unreadable = run.weights_dir(29)
    shutil.copytree(run.weights_dir(1), unreadable)
    against = refused_delta(server, 30, 29)
    (unreadable / wd.DIGEST).write_text("{not json")
    answers["no digest"] = update(url, against, 30)
    # Killed while writing: the staging directory never becomes a version.
    staged = run.weights / ".step_25.tmp"
    shutil.copytree(run.weights_dir(4), staged)
    (staged / STABLE).unlink()
    answers["staged"] = update(url, run.weights_dir(25), 25)
    for case, (status, text) in answers.items():
        assert status in (404, 409), (case, status, text)
        assert "\n" not in detail(text), (case, text)
    for case in ("missing", "other run", "damaged", "tampered", "other bytes", "no digest"):
        assert wd.REFUSED in answers[case][1], (case, answers[case])
    assert answers["other bytes"][0] == 409 and "it is against version 1 with checksum 0000000000000000" in \
        answers["other bytes"][1] and "holds version 1 with checksum" in answers["other bytes"][1], answers
    assert answers["no digest"][0] == 409 and f"has no readable {wd.DIGEST}" in answers["no digest"][1], answers
    assert "version 19, is missing" in answers["missing"][1]
    assert "belongs to run other" in answers["other run"][1]
    assert "is damaged" in answers["damaged"][1] and "still serves version 4" in answers["damaged"][1]
    assert "has checksum" in answers["tampered"][1] and "still serves version 4" in answers["tampered"][1]
    assert "rolled back" not in server.proc.log.read_text()
    assert serving(url) == 4 and greedy(url) == before
    # And the next good delta loads.
    assert update(url, run.weights_dir(3), 26)[0] == 400  # a delta's version is its own
    status, text = update(url, refused_delta(server, 27, 1), 27)
    assert status == 200, text
    assert greedy(url) == before  # version 4's values again, as version 27


def test_a_server_with_delta_off_refuses_a_delta_before_the_update_lock(tmp_path):
    """weight_sync.delta = false: no base is kept to rebuild from, so a delta directory is refused
    with one line before the update lock (before any engine call: this server has none)."""
    import asyncio

    from fastapi import HTTPException

    from inference.access import WeightRoots
    from inference.adapters import AdaptersOff
    from inference.generation import Generations
    from inference.reload import ServedWeights
    from rl.inference_api import UpdateWeightsRequest

    run = RunDir(tmp_path / "run")
    run.make()
    pub, policy = publisher(run)
    for step in (1, 2):
        pub.deliver(policy, step, step_tensors(step))
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(run.root)})
    assert not cfg.weight_sync.delta
    weights = ServedWeights(cfg, WeightRoots(cfg), Generations(cfg.seq_len, AdaptersOff(None, 0)))
    body = UpdateWeightsRequest(path=str(run.weights_dir(2)), version=2, mode="wait")
    with pytest.raises(HTTPException) as e:
        asyncio.run(weights.update_weights(body))
    assert e.value.status_code == 409 and "\n" not in e.value.detail
    assert "holds a weight delta, but this server's weight_sync.delta is false" in e.value.detail, e.value.detail
    assert str(run.weights_dir(2)) in e.value.detail and not weights.lock.locked()
