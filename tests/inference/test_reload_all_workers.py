"""A reload is every worker's or none (issue 60, items 1-2): the worker extension driven as
several workers (tensor-parallel ranks, or data-parallel engines), the server's ServedWeights
deciding.

vLLM's CPU backend runs one worker per engine here (tensor parallelism on two busy cores would
take minutes per start), so the workers are stand-ins: each is the real WeightReloadExtension
(staging, delta rebuild, broadcast receiving, base keeping) on a stand-in of vLLM's worker whose
reload_weights records what it loaded. The engine stand-in calls every worker at once, each in a
thread, as vLLM's multiprocess executor does. What a real engine adds (vLLM's own reload) is
tested on a real server in test_weight_delta.py and test_weight_delta_broadcast.py.

- A delta that one worker refuses (its base differs in memory) loads on no worker: the others'
  bases get their own values back, and the server still serves its version.
- A full version that one worker cannot read (a MemoryError) loads on no worker.
- A data-parallel server: engine 1's refusal is seen (vLLM's DP client answers collective_rpc
  with engine 0's workers only).
- A full broadcast version whose tensors do not match its digest is refused before any worker
  loads it, the sender is told, one line says so; the next good version loads. A broadcast delta
  one worker refuses loads on no worker either.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from fastapi import HTTPException

from conftest import TINY_MODEL, free_port
from inference.access import WeightRoots
from inference.adapters import AdaptersOff
from inference.generation import Generations
from inference.reload import ServedWeights
from inference.worker_extension import WeightReloadExtension
from rl.config import RunConfig
from rl.inference_api import InitBroadcasterRequest, UpdateWeightsRequest
from rl.rundir import RunDir, mark_stable
from rl.weights import broadcast as bc
from rl.weights import delta as wd
from weight_versions import EMBED, publisher, step_tensors


class Worker(WeightReloadExtension):
    """vLLM's worker as far as the extension reaches: reload_weights loads (name, tensor) pairs
    or a directory's safetensors; `loaded` is the checksum of each version it loaded."""

    def __init__(self, rank: int):
        self.rank, self.device = rank, torch.device("cpu")
        config = SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=False))
        model = torch.nn.Module()
        self.model_runner = SimpleNamespace(get_model=lambda: model, model_config=config)
        self.loaded: list[str] = []

    def reload_weights(self, weights_path=None, weights_iterator=None):
        if weights_path is not None:
            tensors = {}
            for f in sorted(Path(weights_path).glob("*.safetensors")):
                tensors.update(safetensors.torch.load(f.read_bytes()))  # not load_file: tests patch it
        else:
            tensors = {name: t.clone() for name, t in weights_iterator}
        self.loaded.append(wd.checksum(tensors))


class Engine:
    """vLLM's AsyncLLM as ServedWeights calls it, over `engines` (lists of workers): one engine is
    a tensor-parallel engine; several, a data-parallel server, whose collective_rpc answers with
    engine 0's workers only, as vLLM 0.32's DPLBAsyncMPClient.call_utility_async does."""

    def __init__(self, *engines: list[Worker]):
        self.engines = engines
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=len(engines[0])))
        self.model_config = SimpleNamespace(is_multimodal_model=False)  # a text model: no encoder cache to reset
        self.labels: list[str] = []
        if len(engines) > 1:
            self.engine_core = SimpleNamespace(call_utility_all_async=self.call_utility_all_async)

    async def call_engine(self, workers, method, args):
        return list(await asyncio.gather(*(asyncio.to_thread(getattr(w, method), *args) for w in workers)))

    async def call_utility_all_async(self, utility, method, timeout, args, kwargs):
        assert utility == "collective_rpc" and kwargs is None
        return list(await asyncio.gather(*(self.call_engine(ws, method, args) for ws in self.engines)))

    async def collective_rpc(self, method, timeout=None, args=()):
        return (await self.call_utility_all_async("collective_rpc", method, timeout, args, None))[0]

    async def pause_generation(self, mode, clear_cache):
        pass

    async def update_weight_version(self, label):
        self.labels.append(label)

    async def resume_generation(self):
        pass

    async def reset_prefix_cache(self):
        return True

    async def abort(self, ids):
        pass


def served(run: RunDir, engine: Engine, timeouts: dict | None = None, **weight_sync) -> ServedWeights:
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(run.root),
                                    "weight_sync": {"delta": True, **weight_sync}, "timeouts": timeouts or {}})
    weights = ServedWeights(cfg, WeightRoots(cfg), Generations(cfg.seq_len, AdaptersOff(None, 0)))
    weights.engine = weights.generations.engine = engine
    return weights


def update(weights: ServedWeights, path: Path, version: int) -> dict:
    return asyncio.run(weights.update_weights(UpdateWeightsRequest(path=str(path), version=version, mode="keep")))


def refused(weights: ServedWeights, path: Path, version: int) -> str:
    with pytest.raises(HTTPException) as e:
        update(weights, path, version)
    assert e.value.status_code == 409, e.value.detail
    assert "\n" not in e.value.detail
    return e.value.detail


def versions(tmp_path) -> RunDir:
    """weights/step_1 full (with its digest), step_2 a delta against it, step_3 full again."""
    run = RunDir(tmp_path / "run")
    run.make()
    pub, policy = publisher(run, full_every=2, keep=10)
    for step in (1, 2, 3):
        pub.deliver(policy, step, step_tensors(step))
    assert (run.weights_dir(2) / wd.MANIFEST).exists() and (run.weights_dir(3) / wd.DIGEST).exists()
    return run


def checksum_of(run: RunDir, version: int) -> str:
    if (run.weights_dir(version) / wd.MANIFEST).exists():
        return wd.read_manifest(run.weights_dir(version)).checksum
    return wd.Digest.read(run.weights_dir(version)).checksum


def test_a_delta_one_worker_refuses_loads_on_no_worker(tmp_path):
    run = versions(tmp_path)
    workers = [Worker(0), Worker(1)]
    weights = served(run, Engine(workers))
    update(weights, run.weights_dir(1), 1)
    assert [w.loaded for w in workers] == [[checksum_of(run, 1)]] * 2
    # Worker 1's base differs in memory from the version its digest names (as after a bad copy).
    own = workers[1]._asyncrl_base.tensors[EMBED][0, 0].item()
    workers[1]._asyncrl_base.tensors[EMBED][0, 0] += 1.0
    detail = refused(weights, run.weights_dir(2), 2)
    assert [w.loaded for w in workers] == [[checksum_of(run, 1)]] * 2  # worker 0 did not load version 2
    assert wd.REFUSED in detail and "has checksum" in detail and "still serves version 1" in detail, detail
    assert "worker 1; 1 of 2 workers refused, none loaded it" in detail, detail
    # Worker 0 rebuilt version 2 in its base and put the base's own values back.
    assert wd.checksum(workers[0]._asyncrl_base.tensors) == checksum_of(run, 1)
    assert weights.generations.version == 1 and weights.engine.labels == ["1"]
    # Each worker drops what it staged; a good version then loads on both.
    assert all(getattr(w, "_asyncrl_staged", None) is None for w in workers)
    workers[1]._asyncrl_base.tensors[EMBED][0, 0] = own
    update(weights, run.weights_dir(2), 2)
    assert [w.loaded[-1] for w in workers] == [checksum_of(run, 2)] * 2


def test_a_full_version_one_worker_cannot_read_loads_on_no_worker(tmp_path, monkeypatch):
    run = versions(tmp_path)
    workers = [Worker(0), Worker(1)]
    weights = served(run, Engine(workers))
    update(weights, run.weights_dir(1), 1)
    read, lock, calls = safetensors.torch.load_file, threading.Lock(), []

    def second_read_fails(*args, **kwargs):
        with lock:
            calls.append(1)
            if len(calls) == 2:
                raise MemoryError("no room for another copy of the weights")
        return read(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "load_file", second_read_fails)
    detail = refused(weights, run.weights_dir(3), 3)
    assert [w.loaded for w in workers] == [[checksum_of(run, 1)]] * 2
    assert "cannot be read: MemoryError" in detail and "none loaded it" in detail, detail
    assert [w._asyncrl_held() for w in workers] == [[wd.Digest.read(run.weights_dir(1)).run_id, 1,
                                                     checksum_of(run, 1)]] * 2


def test_a_data_parallel_engine_that_refuses_is_heard(tmp_path):
    run = versions(tmp_path)
    engines = [[Worker(0)], [Worker(0)]]
    weights = served(run, Engine(*engines))
    update(weights, run.weights_dir(1), 1)
    assert [ws[0].loaded for ws in engines] == [[checksum_of(run, 1)]] * 2  # every engine loads
    engines[1][0]._asyncrl_base.tensors[EMBED][0, 0] += 1.0
    detail = refused(weights, run.weights_dir(2), 2)
    assert "worker 1; 1 of 2 workers refused" in detail, detail
    assert engines[0][0].loaded == [checksum_of(run, 1)]


def broadcast_version(run: RunDir, version: int, tensors: dict, checksum: str) -> tuple[Path, bc.Manifest]:
    """weights/step_<version> as the trainer's BroadcastPublisher writes a full version with a
    digest (delta = true), the digest's checksum `checksum`."""
    directory = run.weights_dir(version)
    directory.mkdir(parents=True)
    manifest = bc.make_manifest(version, tensors, 1 << 20)
    (directory / bc.MANIFEST).write_bytes(manifest.to_json())
    (directory / wd.DIGEST).write_bytes(wd.Digest("run", version, checksum).to_json())
    mark_stable(directory)
    return directory, manifest


class Broadcast:
    """Two stand-in workers joined to a real gloo broadcast group (ranks 1 and 2) through the
    server's /init_broadcaster, and the trainer's side of it (rank 0) in this process."""

    def __init__(self, tmp_path):
        self.run = RunDir(tmp_path / "run")
        self.run.make()
        address = f"127.0.0.1:{free_port()}"
        self.workers = [Worker(0), Worker(1)]
        self.weights = served(self.run, Engine(self.workers), kind="broadcast", address=address,
                               timeouts={"broadcast_s": 60})
        box: dict = {}
        host = threading.Thread(target=lambda: box.update(group=bc.host_group(address, 60, "cpu")))
        host.start()
        joined = asyncio.run(self.weights.init_broadcaster(InitBroadcasterRequest(address=address, rank_offset=1,
                                                                                  world_size=3)))
        host.join(60)
        assert joined["ranks"] == [1, 2]
        self.group = box["group"]

    def update(self, directory: Path, version: int, manifest: bc.Manifest, tensors: dict) -> tuple[str, str]:
        """Send `tensors` while the server updates to `version`: the refusal's detail ("" when it
        loaded) and the sender's error ("" when every receiver loaded it)."""
        box: dict = {}

        def send():
            try:
                bc.send_version(self.group, manifest, tensors)
            except bc.BroadcastError as e:
                box["sender"] = str(e)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            update(self.weights, directory, version)
            detail = ""
        except HTTPException as e:
            assert e.status_code == 409, e.detail
            detail = e.detail
            assert "\n" not in detail
        sender.join(60)
        return detail, box.get("sender", "")


def test_a_full_broadcast_version_not_matching_its_digest_is_refused_on_every_worker(tmp_path):
    b = Broadcast(tmp_path)
    good = {k: v for k, v in step_tensors(1).items() if k != "lm_head.weight"}
    damaged = {k: v.clone() for k, v in good.items()}
    damaged[EMBED][0, 0] += 1.0  # what arrives is not what the digest names
    try:
        directory, manifest = broadcast_version(b.run, 1, damaged, wd.checksum(good))
        detail, sender = b.update(directory, 1, manifest, damaged)
        assert [w.loaded for w in b.workers] == [[], []]
        assert "arrived by broadcast with checksum" in detail and "refused before loading" in detail, detail
        assert "none loaded it" in detail and "still serves version 0" in detail, detail
        assert "failed to load on rank 1" in sender, sender
        directory, manifest = broadcast_version(b.run, 2, good, wd.checksum(good))
        assert b.update(directory, 2, manifest, good) == ("", "")
        assert [w.loaded for w in b.workers] == [[wd.checksum(good)]] * 2
        assert [w._asyncrl_held()[1:] for w in b.workers] == [[2, wd.checksum(good)]] * 2
    finally:
        b.group.close()


def test_a_broadcast_delta_one_worker_refuses_loads_on_no_worker(tmp_path):
    b = Broadcast(tmp_path)
    good = {k: v for k, v in step_tensors(1).items() if k != "lm_head.weight"}
    new = {k: v for k, v in step_tensors(2).items() if k != "lm_head.weight"}
    workers = b.workers
    try:
        directory, manifest = broadcast_version(b.run, 2, good, wd.checksum(good))
        assert b.update(directory, 2, manifest, good) == ("", "")
        # Worker 1's base differs in memory from the version its digest names.
        own = workers[1]._asyncrl_base.tensors[EMBED][0, 0].item()
        workers[1]._asyncrl_base.tensors[EMBED][0, 0] += 1.0
        directory, manifest, changes = broadcast_delta(b.run, 3, good, new)
        detail, sender = b.update(directory, 3, manifest, changes)
        assert [w.loaded for w in workers] == [[wd.checksum(good)]] * 2  # worker 0 did not load it
        assert "has checksum" in detail and "worker 1; 1 of 2 workers refused, none loaded it" in detail, detail
        assert "failed to load on rank 1" in sender, sender
        assert wd.checksum(workers[0]._asyncrl_base.tensors) == wd.checksum(good)
        workers[1]._asyncrl_base.tensors[EMBED][0, 0] = own
        directory, manifest, changes = broadcast_delta(b.run, 4, good, new)
        assert b.update(directory, 4, manifest, changes) == ("", "")
        assert [w.loaded[-1] for w in workers] == [wd.checksum(new)] * 2
    finally:
        b.group.close()


def broadcast_delta(run: RunDir, version: int, base: dict, new: dict) -> tuple[Path, bc.Manifest, dict]:
    """weights/step_<version> as the BroadcastPublisher writes a delta against version 2 (`base`)."""
    directory = run.weights_dir(version)
    directory.mkdir(parents=True)
    entries, changes = wd.encode(base, new)
    delta = wd.Manifest("run", version, 2, wd.checksum(base), wd.checksum(new), entries)
    (directory / wd.MANIFEST).write_bytes(delta.to_json())
    manifest = bc.make_manifest(version, changes, 1 << 20)
    (directory / bc.MANIFEST).write_bytes(manifest.to_json())
    mark_stable(directory)
    return directory, manifest, changes


def test_a_round_left_staged_is_dropped_before_the_next_is_staged(tmp_path):
    """A round the server never finished (it died between stage and commit) leaves a delta
    patched into the worker's base: the next stage drops it first, then rebuilds, so the commit
    loads exactly the version (before: the late drop put the base's values back under the new
    round's rebuilt tensors, and the commit loaded the base's values as the new version)."""
    run = versions(tmp_path)
    worker = Worker(0)
    assert worker.asyncrl_stage_full(str(run.weights_dir(1))) == {}
    worker.asyncrl_commit()
    assert worker.asyncrl_stage_delta(str(run.weights_dir(2))) == {}
    assert worker.asyncrl_stage_delta(str(run.weights_dir(2))) == {}  # the server asks again
    answer = worker.asyncrl_commit()
    assert worker.loaded == [checksum_of(run, 1), checksum_of(run, 2)]
    assert answer["checksum"] == checksum_of(run, 2)
    assert wd.checksum(worker._asyncrl_base.tensors) == checksum_of(run, 1)  # the base's own values
