"""Weight sync by broadcast (rl/weights/broadcast.py, trainer/broadcast.py, the server's /init_broadcaster
and broadcast /update_weights): bucket planning and packing, the handshake between real processes
over gloo, and one real vLLM server receiving a version by broadcast."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, free_port

from rl.weights import broadcast as bc
from rl.config import RunConfig
from rl.rundir import STABLE, RunDir

pytestmark = pytest.mark.slow

# Heavier imports (trainer, aiohttp, safetensors) live inside the tests: the receiver processes
# are spawned and import this module, and on two busy cores every second counts against the
# handshake's timeouts.

# --- planning and packing --------------------------------------------------------------------


def mixed_state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(30, 16, generator=g),
        "layer.0.norm": torch.randn(16, generator=g).to(torch.bfloat16),
        "layer.0.big": torch.randn(300_000, generator=g),  # 1.2 MB: over a 1 MiB bucket
        "layer.0.half": torch.randn(7, 3, generator=g).to(torch.float16),
        "layer.0.count": torch.randint(-(2**40), 2**40, (5,), generator=g),
        "layer.0.mask": torch.rand(9, generator=g) > 0.5,
        "layer.0.scalar": torch.tensor(3.5, dtype=torch.float64),
        "layer.0.empty": torch.zeros(0, 4),
        "lm_head.weight": torch.randn(30, 16, generator=g),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def test_plan_buckets_keeps_order_and_gives_a_big_tensor_its_own_bucket():
    sizes = [("a", 400), ("b", 500), ("c", 5000), ("d", 10), ("e", 90)]
    plan = bc.plan_buckets(sizes, 1024)
    assert plan == [["a", "b"], ["c"], ["d", "e"]]
    assert [n for b in plan for n in b] == [n for n, _ in sizes]
    assert bc.plan_buckets(sizes, 1024) == plan  # deterministic
    assert bc.plan_buckets([("x", 5000)], 1024) == [["x"]]
    assert bc.plan_buckets([], 1024) == []


def test_pack_unpack_round_trip_is_bit_identical_with_mixed_dtypes():
    sd = mixed_state_dict(0)
    manifest = bc.make_manifest(7, sd, 1 << 20)
    assert manifest.names == list(sd)  # the model's order, not sorted
    big = [b for b in manifest.buckets if any(t.name == "layer.0.big" for t in b.tensors)]
    assert len(big) == 1 and len(big[0].tensors) == 1 and big[0].nbytes == 1_200_000
    assert len(manifest.buckets) == 3
    assert manifest.total_bytes == sum(b.nbytes for b in manifest.buckets)
    out = {}
    for bucket in manifest.buckets:
        buf = bc.pack_bucket(bucket, sd)
        assert buf.dtype == torch.uint8 and buf.numel() == bucket.nbytes
        for name, t in bc.unpack_bucket(bucket, buf.clone()):
            assert t.untyped_storage().data_ptr() != 0 or t.numel() == 0
            out[name] = t
    assert list(out) == list(sd)
    for name, t in sd.items():
        assert same_bits(out[name], t), name
    assert out["layer.0.norm"].dtype == torch.bfloat16 and out["layer.0.scalar"].shape == ()
    # Views, not copies: one storage per bucket.
    first = manifest.buckets[0]
    buf = bc.pack_bucket(first, sd)
    views = bc.unpack_bucket(first, buf)
    assert all(v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for _, v in views)


def test_manifest_json_round_trip_and_validation():
    sd = mixed_state_dict(1)
    manifest = bc.make_manifest(3, sd, 1 << 20)
    raw = manifest.to_json()
    data = json.loads(raw)  # plain JSON, nothing else
    assert data["version"] == 3 and data["format"] == bc.FORMAT
    assert data["buckets"][0]["tensors"][0] == {"name": "embed.weight", "dtype": "float32", "shape": [30, 16],
                                                "offset": 0, "nbytes": 30 * 16 * 4}
    again = bc.Manifest.from_json(raw)
    assert again == manifest and again.digest() == manifest.digest()
    assert bc.make_manifest(3, mixed_state_dict(2), 1 << 20).to_json() == raw  # same shapes, same plan
    data["buckets"][0]["tensors"][1]["offset"] = 3
    with pytest.raises(ValueError, match="misaligned"):
        bc.Manifest.from_json(json.dumps(data))
    data = json.loads(raw)
    data["buckets"][0]["tensors"][0]["dtype"] = "complex64"
    with pytest.raises(ValueError, match="unsupported dtype"):
        bc.Manifest.from_json(json.dumps(data))
    data = json.loads(raw)
    data["buckets"][0]["tensors"][0]["shape"] = [30, 17]
    with pytest.raises(ValueError, match="do not hold"):
        bc.Manifest.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not a"):
        bc.Manifest.from_json(b'{"version": 1}')
    with pytest.raises(ValueError, match="does not match the manifest"):
        bc.pack_bucket(manifest.buckets[0], {**sd, "embed.weight": sd["embed.weight"].double()})


def test_parse_address():
    assert bc.parse_address("127.0.0.1:29710") == ("127.0.0.1", 29710)
    assert bc.parse_address("[::1]:5") == ("::1", 5)
    for bad in ("127.0.0.1", ":80", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError, match="host:port"):
            bc.parse_address(bad)


# --- the handshake between real processes, over gloo ----------------------------------------


def config(tmp: Path, address: str, timeout_s: float, bucket_mb: int = 1) -> RunConfig:
    return RunConfig.model_validate({
        "model": str(TINY_MODEL), "output_dir": str(tmp / "run"),
        "weight_sync": {"kind": "broadcast", "address": address, "bucket_mb": bucket_mb},
        "timeouts": {"broadcast_s": timeout_s}, "trainer": {"files": {"keep_weights": 1}},
    })


def sender_side(tmp: Path, timeout_s: float) -> tuple[str, RunConfig, RunDir]:
    """A fresh address, the sender's config and its run directory."""
    address = f"127.0.0.1:{free_port()}"
    cfg = config(tmp, address, timeout_s=timeout_s)
    run = RunDir(cfg.output_dir)
    run.make()
    return address, cfg, run


def reap(procs, kill_first: bool = False) -> None:
    """Receivers end on their own (or, kill_first, are still waiting for a version)."""
    for p in procs:
        if kill_first:
            p.kill()
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def receiver(address: str, rank: int, world: int, run_root: str, versions: list[int], timeout_s: float, results,
             ready=None, linger_s: float = 0.0, fail: bool = False) -> None:
    """Stands in for one inference worker: joins, then for each version waits for STABLE (the
    orchestrator's cue) and receives."""
    if ready is not None:
        ready.set()  # imports done: what is left is fast
    try:
        group = bc.join_group(address, rank, world, timeout_s, "cpu", who=f"test receiver {rank}")
        run = RunDir(run_root)
        for v in versions:
            directory = run.weights_dir(v)
            deadline = time.monotonic() + timeout_s
            while not (directory / STABLE).exists():
                assert time.monotonic() < deadline, f"no STABLE for version {v}"
                time.sleep(0.01)
            incoming = bc.Incoming(group, bc.read_manifest(directory))
            if fail:  # a load that broke before taking any tensor: finish() drains the rest
                incoming.finish(False)
                results.put((rank, v, True, []))
                continue
            got = dict(incoming.tensors())
            incoming.finish(True)
            expected = {k: t for k, t in mixed_state_dict(v).items() if k != "lm_head.weight"}
            bad = [k for k in expected if k not in got or not same_bits(got[k], expected[k])]
            results.put((rank, v, sorted(got) == sorted(expected) and not bad, bad))
        time.sleep(linger_s)  # alive, in the group, but taking no part
        group.close()
    except BaseException as e:  # reported, not lost in the child
        results.put((rank, None, False, f"{type(e).__name__}: {e}"))


def start_receivers(ctx, address, ranks, world, run_root, versions, timeout_s):
    results = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(address, r, world, run_root, versions, timeout_s, results))
             for r in ranks]
    for p in procs:
        p.start()
    return procs, results


def test_two_receivers_get_two_versions_bit_identical(tmp_path):
    from trainer.broadcast import WeightBroadcaster

    address, cfg, run = sender_side(tmp_path, 60)
    ctx = mp.get_context("spawn")
    procs, results = start_receivers(ctx, address, [1, 2], 3, str(run.root), [1, 2], 60)
    try:
        sender = WeightBroadcaster(cfg, run, tied=True)  # returns once both joined
        assert sender.group.world_size == 3 and sender.group.backend_name == "gloo"
        for v in (1, 2):
            seconds = sender.publish(v, mixed_state_dict(v))
            assert seconds > 0
            directory = run.weights_dir(v)
            assert (directory / STABLE).exists() and (directory / bc.DELIVERED).exists()
            manifest = bc.read_manifest(directory)
            assert manifest.version == v and "lm_head.weight" not in manifest.names  # tied
            assert len(manifest.buckets) == 3  # 1 MiB buckets, the 1.2 MB tensor alone
        reports = [results.get(timeout=60) for _ in range(4)]
        sender.close()
    finally:
        reap(procs)
    assert sorted((r, v) for r, v, _, _ in reports) == [(1, 1), (1, 2), (2, 1), (2, 2)], reports
    assert all(ok for _, _, ok, _ in reports), reports
    # keep_weights = 1: the tiny broadcast directories are pruned like file versions.
    assert run.weight_steps() == [2]


def test_a_receiver_that_never_joins_fails_the_sender_naming_the_address(tmp_path):
    from trainer.broadcast import WeightBroadcaster

    address, cfg, run = sender_side(tmp_path, 8)
    ctx = mp.get_context("spawn")
    # Rank 1 joins a group of 3; rank 2 never comes.
    results, ready = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=receiver, args=(address, 1, 3, str(run.root), [1], 8, results, ready))]
    procs[0].start()
    try:
        assert ready.wait(60)
        start = time.monotonic()
        with pytest.raises(bc.BroadcastTimeout) as err:
            WeightBroadcaster(cfg, run, tied=False)
        waited = time.monotonic() - start
        rank, _, ok, why = results.get(timeout=30)
    finally:
        reap(procs)
    message = str(err.value)
    assert address in message and "never joined: [2]" in message and "timeouts.broadcast_s" in message
    # Not before its timeout (rl/weights/broadcast.py allows the backend's timers 5% early); with rank 2
    # never coming nothing but that timeout ends the wait, so the error itself shows it fired.
    assert waited >= 0.95 * cfg.timeouts.broadcast_s, waited
    assert rank == 1 and not ok and address in why


def test_a_member_missing_from_a_version_fails_publish_naming_the_address(tmp_path):
    from trainer.broadcast import WeightBroadcaster

    address, cfg, run = sender_side(tmp_path, 60)
    ctx = mp.get_context("spawn")
    # Both join; rank 2 takes version 1 but not version 2 (a server nobody told about it).
    results = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(address, 1, 3, str(run.root), [1, 2], 60, results)),
             ctx.Process(target=receiver, args=(address, 2, 3, str(run.root), [1], 60, results, None, 60))]
    for p in procs:
        p.start()
    try:
        sender = WeightBroadcaster(cfg, run, tied=False)
        sender.group.timeout_s = 3  # joining waits for slow process starts; the broadcast need not
        sender.publish(1, mixed_state_dict(1))
        start = time.monotonic()
        with pytest.raises(bc.BroadcastTimeout) as err:
            sender.publish(2, mixed_state_dict(2))
        waited = time.monotonic() - start
        sender.close()
    finally:
        reap(procs, kill_first=True)  # rank 1 still waits for the rest of version 2
    assert address in str(err.value) and "version 2" in str(err.value)
    # At its own timeout (3 s; rl/weights/broadcast.py allows the backend's timers 5% early), before the
    # receivers' (60 s), the only other thing that could have ended the broadcast.
    assert 0.95 * 3 <= waited < 60, waited
    assert not (run.weights_dir(2) / bc.DELIVERED).exists()


def test_a_failed_load_is_reported_to_the_sender_naming_the_receiver(tmp_path):
    from trainer.broadcast import WeightBroadcaster

    address, cfg, run = sender_side(tmp_path, 60)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(address, 1, 2, str(run.root), [1, 2], 60, results, None, 0, True))]
    procs[0].start()
    try:
        sender = WeightBroadcaster(cfg, run, tied=False)
        for v in (1, 2):  # the group stays in step after a failure
            with pytest.raises(bc.BroadcastError, match=r"version \d failed to load on rank 1 \(test receiver 1\)"):
                sender.publish(v, mixed_state_dict(v))
        reports = [results.get(timeout=30) for _ in range(2)]
        sender.close()
    finally:
        reap(procs)
    assert [(r, v) for r, v, _, _ in reports] == [(1, 1), (1, 2)], reports
    assert not (run.weights_dir(1) / bc.DELIVERED).exists()


# --- a real vLLM server ------------------------------------------------------------------------

Z, A, EQ = 28, 3, 29
PROMPTS = [[A, 4, 5, 6, EQ], [Z, 7, 8, EQ], [10, 11, 12, 13, 14, EQ]]


MOE_MODEL = TINY_MODEL.parent / "tiny-moe"  # the same tokenizer; every layer 4 experts, top 2


# The MoE model: vLLM's CPU MoE kernel must re-pack its experts after a broadcast load as after a
# file reload (inference/worker_extension.py repack_cpu_experts), or it computes from scrambled
# weights; transformers' greedy tokens below would tell.
@pytest.fixture(scope="module", params=[TINY_MODEL, MOE_MODEL], ids=["dense", "moe"])
def vllm_server(tmp_path_factory, request):
    from programs import Program

    model = request.param
    tmp = tmp_path_factory.mktemp("broadcast")
    run = RunDir(tmp / "run")
    run.make()
    port, address = free_port(), f"127.0.0.1:{free_port()}"
    cfg = tmp / "server.toml"
    cfg.write_text(f'model = "{model}"\noutput_dir = "{run.root}"\nseq_len = 64\n'
                   f'[inference]\nport = {port}\ndtype = "float32"\n'
                   f'[weight_sync]\nkind = "broadcast"\naddress = "{address}"\n[timeouts]\nbroadcast_s = 60\n')
    server = Program("inference", cfg, tmp)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 240
    while True:
        assert server.proc.poll() is None, server.tail()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.5)
    try:
        yield {"url": url, "run": run, "address": address, "cfg": cfg, "tmp": tmp, "server": server, "model": model}
    finally:
        server.stop()


async def greedy(s, url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        async with s.post(f"{url}/generate", json={"request_id": f"g{time.monotonic_ns()}-{i}",
                                                   "prompt_token_ids": prompt, "max_tokens": 12,
                                                   "temperature": 0}) as r:
            data = await r.json()
            assert r.status == 200, data
        sample = data["samples"][0]
        out.append((sample["token_ids"], sample["logprobs"]))
    return out


def hf_greedy(directory: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=1, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def test_real_server_receives_a_version_by_broadcast(vllm_server):
    """The orchestrator's own ServerPool drives the server: /init_broadcaster with the rank it
    computes from /health, then /update_weights on the broadcast directory while the trainer's
    WeightBroadcaster sends. The result must equal a filesystem reload of the same tensors."""
    import aiohttp
    from rl.inference_api import connector
    from safetensors.torch import load_file, save_file

    from orchestrator.servers.delivery import BroadcastDelivery
    from orchestrator.servers.pool import ServerPool
    from trainer.broadcast import WeightBroadcaster

    url, run, address, model = vllm_server["url"], vllm_server["run"], vllm_server["address"], vllm_server["model"]
    cfg = RunConfig.model_validate({"model": str(model), "output_dir": str(run.root),
                                    "weight_sync": {"kind": "broadcast", "address": address},
                                    "timeouts": {"broadcast_s": 60}})
    base = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    new = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v
           for k, v in base.items()}
    files = run.weights / "files"  # the same tensors as an HF directory, for the comparison
    shutil.copytree(model, files)
    save_file(new, files / "model.safetensors")
    sender: dict = {}

    def in_thread(fn):
        def go():
            try:
                sender["result"] = fn()
            except BaseException as e:
                sender["error"] = e
        t = threading.Thread(target=go)
        t.start()
        return t

    async def main():
        async with aiohttp.ClientSession(connector=connector()) as s:
            async with s.get(f"{url}/broadcaster") as r:
                info = await r.json()
            before = await greedy(s, url)
            errors = {}
            for name, body in {"address": {"address": "127.0.0.1:1", "rank_offset": 1, "world_size": 2},
                               "world": {"address": address, "rank_offset": 2, "world_size": 2},
                               "offset": {"address": address, "rank_offset": 0, "world_size": 2}}.items():
                async with s.post(f"{url}/init_broadcaster", json=body) as r:
                    errors[name] = (r.status, await r.text())
            pool = ServerPool([url], s, None, 30, lambda p: BroadcastDelivery(p, 60, None, False, address, 60))
            await pool.connect(30)
            thread = in_thread(lambda: WeightBroadcaster(cfg, run, tied=True))
            await pool.delivery.prepare()
            await asyncio.to_thread(thread.join)
            assert "error" not in sender, sender.get("error")
            broadcaster = sender.pop("result")
            async with s.post(f"{url}/init_broadcaster",
                              json={"address": address, "rank_offset": 1, "world_size": 2}) as r:
                again = await r.json()
            state = {**new, "lm_head.weight": new["model.embed_tokens.weight"]}  # what FSDP hands over
            thread = in_thread(lambda: broadcaster.publish(1, state))
            while not (run.weights_dir(1) / STABLE).exists():  # the orchestrator's cue
                await asyncio.sleep(0.01)
            await pool.delivery.load(1, run.weights_dir(1))
            await asyncio.to_thread(thread.join)
            assert "error" not in sender, sender.get("error")
            by_broadcast = await greedy(s, url)
            async with s.get(f"{url}/health") as r:
                after = await r.json()
            async with s.post(f"{url}/update_weights", json={"path": str(files), "version": 2}) as r:
                assert r.status == 200, await r.text()
            by_files = await greedy(s, url)
            # Version 1 was delivered while this server moved on: it cannot receive it again.
            async with s.post(f"{url}/update_weights", json={"path": str(run.weights_dir(1)), "version": 1}) as r:
                missed = (r.status, await r.text())
            broadcaster.close()
            async with s.get(f"{url}/broadcaster") as r:
                joined = await r.json()
            return info, joined, before, errors, pool, again, by_broadcast, after, by_files, missed

    info, joined, before, errors, pool, again, by_broadcast, after, by_files, missed = asyncio.run(main())
    assert info == {"workers": 1, "group": None}
    assert joined == {"workers": 1, "group": {"address": address, "rank_offset": 1, "world_size": 2}}
    assert errors["address"][0] == 403 and "weight_sync.address" in errors["address"][1]
    assert errors["world"][0] == 400 and "world_size" in errors["world"][1]
    assert errors["offset"][0] == 400
    assert again["already"] is True and again["ranks"] == [1]
    assert pool.servers[0].version == 1 and pool.servers[0].healthy
    assert after["version"] == 1
    assert by_broadcast != before
    assert by_broadcast == by_files  # same tokens, same logprobs: bit for bit the same weights
    # And what transformers generates from those weights (tied lm_head included).
    assert [tokens for tokens, _ in by_broadcast] == hf_greedy(files)
    assert missed[0] == 409 and "broadcast without this server" in missed[1]


# --- failures on NCCL, decided and checked on CPU (rl/weights/broadcast.py NCCL_ENV; docs/reliability.md) ----
# No GPU here: ProcessGroupNCCL is faked with the interface Group uses, and what Group relies on
# in torch itself is pinned below (by the real class where torch has NCCL, else by torch's sources).


class FakeNCCL:
    """Stands in for ProcessGroupNCCL (absent from CPU builds): records what its constructor saw
    (the NCCL_ENV keys, the options) and what the group did to it."""

    class Options:
        def __init__(self):
            self._timeout = None

    built: list = []

    def __init__(self, store, rank, size, options):
        import os

        self.env = {k: os.environ.get(k) for k in bc.NCCL_ENV}
        self.options, self.rank, self.size = options, rank, size
        self.connected, self.issued = [], []
        self.aborted = self.shut = 0
        self.work = None  # what the next collective returns
        type(self).built.append(self)

    def eager_connect_single_device(self, device):
        self.connected.append(device)

    def broadcast(self, tensors, opts):
        self.issued.append(("broadcast", opts.timeout))
        return self.work

    def allreduce(self, tensors, opts):
        self.issued.append(("allreduce", opts.timeout))
        return self.work

    def abort(self):
        self.aborted += 1

    def shutdown(self):
        self.shut += 1


class FakeWork:
    """A collective's work: wait(timeout) returns `result` or raises `error`."""

    def __init__(self, result=True, error=None):
        self.result, self.error, self.waits = result, error, []

    def wait(self, timeout):
        self.waits.append(timeout)
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def fake_nccl(monkeypatch):
    """torch.distributed.distributed_c10d.ProcessGroupNCCL, faked; the list of those built."""
    from torch.distributed import distributed_c10d

    built: list = []
    monkeypatch.setattr(FakeNCCL, "built", built)
    monkeypatch.setattr(distributed_c10d, "ProcessGroupNCCL", FakeNCCL, raising=False)
    return built


FAKE_ADDRESS = "127.0.0.1:29999"


def nccl_group(rank: int = 0, world: int = 3, timeout_s: float = 5.0, members=(1, 2)) -> bc.Group:
    """A Group over the faked NCCL on an in-memory store where `members` registered ("cpu": the
    device only decides whether a CUDA stream is synchronized)."""
    import torch.distributed as dist

    store = dist.HashStore()
    for r in members:
        store.set(f"asyncrl/member/{r}", f"fake worker {r}")
    return bc.Group(store, rank, world, "nccl", "cpu", FAKE_ADDRESS, timeout_s)


def test_nccl_groups_are_built_with_blocking_wait_and_no_teardown_gloo_with_nothing():
    assert bc.backend_env("gloo") == {}
    env = bc.backend_env("nccl")
    # Waits raise in the caller (no watchdog thread); a watchdog, should one run, cleans up only
    # (2: never tears the process down); no heartbeat monitor, no dump on timeout.
    assert env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
                   "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    env["TORCH_NCCL_BLOCKING_WAIT"] = "0"
    assert bc.backend_env("nccl")["TORCH_NCCL_BLOCKING_WAIT"] == "1"  # a copy each time


def test_scoped_env_puts_every_key_back_even_when_the_block_raises(monkeypatch):
    import os

    monkeypatch.setenv("ASYNCRL_TEST_SET", "before")
    monkeypatch.delenv("ASYNCRL_TEST_UNSET", raising=False)
    with pytest.raises(ValueError, match="inside"):
        with bc.scoped_env({"ASYNCRL_TEST_SET": "inside", "ASYNCRL_TEST_UNSET": "inside"}):
            assert os.environ["ASYNCRL_TEST_SET"] == os.environ["ASYNCRL_TEST_UNSET"] == "inside"
            raise ValueError("inside")
    assert os.environ["ASYNCRL_TEST_SET"] == "before" and "ASYNCRL_TEST_UNSET" not in os.environ


def test_the_nccl_env_and_timeout_apply_to_the_broadcast_backend_only(fake_nccl, monkeypatch):
    """The constructor sees NCCL_ENV and Options._timeout = timeout_s; the process's own
    settings (read by its other NCCL groups, made later: vLLM's tensor-parallel ones) are back
    right after. A healthy collective waits with timeout_s, and close() shuts the group down."""
    import datetime
    import os

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # the process's own
    others = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_DUMP_ON_TIMEOUT")
    for key in others:
        monkeypatch.delenv(key, raising=False)
    group = nccl_group(timeout_s=7)
    [pg] = fake_nccl
    assert pg.env == bc.NCCL_ENV
    assert pg.options._timeout == datetime.timedelta(seconds=7) and (pg.rank, pg.size) == (0, 3)
    assert pg.connected == [torch.device("cpu")]  # connected at formation, not at the first broadcast
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and not any(k in os.environ for k in others)
    pg.work = FakeWork(result=True)
    group.broadcast(torch.zeros(8, dtype=torch.uint8), "header of version 1")
    assert pg.issued == [("broadcast", datetime.timedelta(seconds=7))]
    assert pg.work.waits == [datetime.timedelta(seconds=7)]
    group.close()
    assert (pg.aborted, pg.shut) == (0, 1)


NCCL_TIMEOUT = "[PG ID 1 PG GUID 1 Rank 0] Work WorkNCCL(SeqNum=5, OpType=BROADCAST, Timeout(ms)=5000) timed out in blocking wait."
NCCL_PEER_GONE = ("NCCL communicator was aborted on rank 1. Original reason for failure was: NCCL error: "
                  "remote process exited or there was a network error")


@pytest.mark.parametrize("rank", [0, 1], ids=["sender", "receiver"])
@pytest.mark.parametrize("outcome", ["wait returns False", "wait raises a timeout", "the peer died"])
def test_a_failed_nccl_collective_raises_naming_the_peer_and_aborts_the_group(fake_nccl, rank, outcome):
    """What blocking wait makes of a collective whose peer never takes part (a DistBackendError
    in the caller once timeout_s passed) or died (an NCCL error): the project's error, naming
    the peer, the group aborted and broken, and the next call refused without touching NCCL."""
    import datetime

    import torch.distributed as dist

    work = {"wait returns False": FakeWork(result=False),
            "wait raises a timeout": FakeWork(error=dist.DistBackendError(NCCL_TIMEOUT)),
            "the peer died": FakeWork(error=dist.DistBackendError(NCCL_PEER_GONE))}[outcome]
    group = nccl_group(rank=rank, timeout_s=5)
    [pg] = fake_nccl
    pg.work = work
    with pytest.raises(bc.BroadcastError) as err:
        group.broadcast(torch.zeros(8, dtype=torch.uint8), "bucket 2/3 of version 4")
    message = str(err.value)
    assert isinstance(err.value, bc.BroadcastTimeout) == (outcome != "the peer died"), message
    peer = "rank 1 (fake worker 1), rank 2 (fake worker 2)" if rank == 0 else f"the trainer (rank 0, hosting {FAKE_ADDRESS})"
    assert peer in message and "bucket 2/3 of version 4" in message and "timeouts.broadcast_s = 5" in message
    assert "did not finish" not in message and "still blocked" not in message
    assert work.waits == [datetime.timedelta(seconds=5)]
    assert pg.aborted == 1 and group.broken == message
    with pytest.raises(bc.BroadcastError, match=r"acknowledgement of version 4 not attempted: it broke earlier"):
        group.all_reduce_sum(torch.zeros(3, dtype=torch.int32), "acknowledgement of version 4")
    assert len(pg.issued) == 1  # refused before NCCL
    group.close()
    assert (pg.aborted, pg.shut) == (1, 0)  # aborted once, never shut down (that would flush)


def test_a_collective_that_fails_to_issue_breaks_the_group_too(fake_nccl):
    import torch.distributed as dist

    group = nccl_group(rank=1)
    [pg] = fake_nccl

    def refuse(tensors, opts):
        raise dist.DistBackendError(NCCL_PEER_GONE)

    pg.broadcast = refuse
    with pytest.raises(bc.BroadcastError, match="the trainer") as err:
        group.broadcast(torch.zeros(8, dtype=torch.uint8), "header of version 2")
    assert pg.aborted == 1 and group.broken == str(err.value)


def test_a_cuda_stream_still_blocked_after_the_abort_is_said(fake_nccl, monkeypatch):
    import torch.distributed as dist

    group = nccl_group(rank=1)
    [pg] = fake_nccl
    pg.work = FakeWork(error=dist.DistBackendError(NCCL_TIMEOUT))
    monkeypatch.setattr(group, "_device_idle", lambda: False)
    with pytest.raises(bc.BroadcastTimeout, match="CUDA stream is still blocked after the abort: restart it"):
        group.broadcast(torch.zeros(8, dtype=torch.uint8), "bucket 1/1 of version 3")


def test_drained_polls_a_stream_until_idle_within_its_bound():
    answers = iter([False, False, True])
    assert bc._drained(lambda: next(answers), seconds=5, poll_s=0.001)
    calls = []
    assert not bc._drained(lambda: calls.append(1) or False, seconds=0.05, poll_s=0.001)
    assert len(calls) >= 2  # polled until its bound, then gave up

    def cuda_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert not bc._drained(cuda_error, seconds=5)


def test_an_nccl_connect_that_never_returns_fails_formation_at_its_timeout(fake_nccl, monkeypatch):
    """ncclCommInitRank has no timeout: a member dying while connecting must not hang formation."""
    release, returned = threading.Event(), []

    def connect(self, device):
        release.wait(60)
        returned.append(device)

    monkeypatch.setattr(FakeNCCL, "eager_connect_single_device", connect)
    try:
        with pytest.raises(bc.BroadcastTimeout, match="forming the group failed") as err:
            nccl_group(timeout_s=0.3)
        assert not returned  # it raised while the connect was still stuck, not after it
    finally:
        release.set()
    [pg] = fake_nccl
    assert pg.aborted == 1
    assert "not up within 0.3 s" in str(err.value) and "ranks that never joined: none" in str(err.value)


def test_a_member_that_never_registers_fails_formation_before_nccl_connects(fake_nccl):
    with pytest.raises(bc.BroadcastTimeout, match=r"ranks that never joined: \[2\]"):
        nccl_group(members=(1,), timeout_s=0.3)
    assert fake_nccl == []  # no communicator was even built


def test_a_gloo_collective_that_times_out_breaks_and_aborts_the_group_on_both_sides():
    """The same with real gloo groups (sender and a receiver in two threads): the sender's
    acknowledgement times out at its timeout_s, names the receiver, aborts its backend (gloo's
    abort finishes) and refuses further calls; the receiver then fails naming the trainer."""
    address = f"127.0.0.1:{free_port()}"
    box: dict = {}

    def join():
        try:
            box["group"] = bc.join_group(address, 1, 2, 60, "cpu", who="thread receiver")
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=join)
    thread.start()
    sender = bc.host_group(address, 60, "cpu")
    thread.join(60)
    receiver = box["group"]
    try:
        sender.timeout_s = receiver.timeout_s = 1  # forming waits for the thread; collectives need not
        with pytest.raises(bc.BroadcastTimeout) as err:
            sender.all_reduce_sum(torch.zeros(2, dtype=torch.int32), "acknowledgement of version 1")
        message = str(err.value)
        assert "rank 1 (thread receiver)" in message and address in message and "did not finish" not in message
        assert sender.broken == message
        with pytest.raises(bc.BroadcastError, match="not attempted: it broke earlier"):
            sender.broadcast(torch.zeros(2, dtype=torch.uint8), "header of version 2")
        # The receiver fails naming the trainer at its next collective, or the one after: the
        # sender had sent its share of the timed-out one, which still sits in the receiver's
        # socket; where the receiver's transport thread has not yet seen the close (a loaded
        # machine: once in a suite run beside other test runs), that collective completes from it.
        calls = [lambda: receiver.all_reduce_sum(torch.zeros(2, dtype=torch.int32), "acknowledgement of version 1"),
                 lambda: receiver.broadcast(torch.zeros(2, dtype=torch.uint8), "header of version 2")]
        with pytest.raises(bc.BroadcastError, match=rf"the trainer \(rank 0, hosting {address}\)"):
            for call in calls:
                call()
        assert receiver.broken
    finally:
        receiver.close()
        sender.close()


# What Group relies on in torch 2.13. Where torch has NCCL, on the class itself; everywhere, in the
# sources torch ships (stubs, Python, the docstrings compiled in), so that a CPU run still fails
# when torch changes under us.


@pytest.mark.skipif(not torch.distributed.is_nccl_available(),
                    reason="this torch has no NCCL (the CPU build): see the test after this one")
def test_the_torch_nccl_surface_group_uses_exists():
    import datetime

    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=3)
    assert options._timeout == datetime.timedelta(seconds=3)
    for name in ("abort", "shutdown", "eager_connect_single_device", "broadcast", "allreduce"):
        assert callable(getattr(ProcessGroupNCCL, name, None)), name


def test_the_torch_nccl_surface_group_uses_is_in_torchs_own_sources():
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    root = Path(torch.__file__).parent

    def stub_class(stubs: str, header: str) -> str:
        body = stubs[stubs.index(header):]
        return body[:body.index("\nclass ", 1)]

    stubs = (root / "_C" / "_distributed_c10d.pyi").read_text()
    nccl = stub_class(stubs, "class ProcessGroupNCCL(Backend):")
    assert "class Options(Backend.Options):" in nccl and "def abort(self) -> None" in nccl
    backend = stub_class(stubs, "class Backend:")
    assert "@_timeout.setter" in backend and "def _timeout(self, val: timedelta) -> None" in backend
    for method in ("def abort(self) -> None", "def shutdown(self) -> None", "def eager_connect_single_device("):
        assert method in backend, method
    assert "def wait(self, timeout: timedelta = ...) -> bool" in stub_class(stubs, "class Work:")
    # A timed wait blocks the calling thread and raises there (init.cpp's docstring, compiled in).
    doc = " ".join(dist.Work.wait.__doc__.split())
    assert "if timeout is set, it will block the CPU thread until the NCCL work is completed or timed out" in doc
    assert "If timeout, exception will be thrown" in doc
    # Blocking wait is a mode torch supports and documents; Options._timeout is what
    # init_process_group itself sets for NCCL.
    c10d = inspect.getsource(distributed_c10d)
    assert "When TORCH_NCCL_BLOCKING_WAIT is set, the process will block and wait for this timeout" in c10d
    assert "backend_options._timeout = timeout" in c10d and "TORCH_NCCL_ASYNC_ERROR_HANDLING" in c10d
    helpers = (root / "testing" / "_internal" / "common_distributed.py").read_text()
    assert 'os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"' in helpers
    # gloo: a real work's timed wait and abort, as Group calls them.
    import datetime

    pg = dist.ProcessGroupGloo(dist.PrefixStore("pin", dist.HashStore()), 0, 1, datetime.timedelta(seconds=5))
    opts = dist.AllreduceOptions()
    opts.timeout = datetime.timedelta(seconds=5)
    assert pg.allreduce([torch.ones(2)], opts).wait(datetime.timedelta(seconds=5)) is True
    pg.abort()
