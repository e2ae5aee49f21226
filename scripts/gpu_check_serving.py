"""The GPU check's items on a real inference server (scripts/gpu_check.py): weights streamed by
broadcast and versions reloaded from files, each compared bit for bit with a fresh load."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from gpu_check_items import CheckFailed, Context, first_line, last_line, write_config

# --- servers ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(ctx: Context, cfg: Path, port: int, name: str, env: dict | None = None, timeout_s: float = 400):
    """A real `rl inference @ cfg` (listening on `port`) until the block ends; yields its URL once
    /health answers. Its log is <item>/<name>.log."""
    log = ctx.path / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "inference", "@", str(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, timeout_s)
        yield url
    finally:
        stop(proc)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed(f"server exited {proc.returncode} before it was ready: {last_line(log)}", log)
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise CheckFailed(f"server not healthy after {timeout_s:.0f} s: {last_line(log)}", log)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to its session (vLLM's engine processes included), SIGKILL what is left after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def prompts(ctx: Context) -> list[list[int]]:
    """A few prompts as token ids, through the orchestrator's own tokenizer."""
    from orchestrator.rendering.tokenizer import load_tokenizer

    tok = load_tokenizer(ctx.model)
    encoded = [tok.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")]
    return [list(getattr(e, "ids", e)) for e in encoded]  # a Rust tokenizer's Encoding, or HF's ids


async def greedy(client, ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Greedy completions through /generate (one at a time: no batching differences), tokens and logprobs."""
    from rl.inference_api import GenerateRequest

    out = []
    for i, prompt in enumerate(ids):
        body = GenerateRequest(request_id=f"check-{time.monotonic_ns()}-{i}", prompt_token_ids=prompt,
                               max_tokens=12, temperature=0)
        sample = (await client.call("generate", 120, body)).samples[0]
        out.append((sample.token_ids, sample.logprobs))
    return out


def compare(got, want, what: str) -> float:
    """Greedy outputs must be the same tokens and logprobs; returns the largest logprob difference."""
    for (tokens, _), (want_tokens, _) in zip(got, want):
        if tokens != want_tokens:
            raise CheckFailed(f"{what}: greedy tokens differ: {tokens} vs {want_tokens}")
    diff = max((abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb)), default=0.0)
    if diff > 0:
        raise CheckFailed(f"{what}: same tokens, logprobs differ by up to {diff:.3g} (expected bit-exact)")
    return diff


# --- model tensors -------------------------------------------------------------------------------


def model_tensors(model: str) -> dict:
    """The checkpoint's tensors as saved (sharded checkpoints merged)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(model).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def perturbed(tensors: dict, seed: int) -> dict:
    """Other weights of the same shapes and dtypes, far enough from these that greedy outputs change."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in tensors.items():
        if v.is_floating_point() and v.numel() > 1:
            f = v.float()
            v = (f + 0.5 * f.std() * torch.randn(f.shape, generator=g)).to(v.dtype)
        out[k] = v
    return out


def write_model_copy(model: str, tensors: dict, dest: Path) -> None:
    """An HF directory: the model's small files and these tensors, for a server to load from files."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True)
    for f in Path(model).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dest / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dest / "model.safetensors")


# --- broadcast -------------------------------------------------------------------------------------


def in_thread(fn, box: dict) -> threading.Thread:
    """Run fn in a thread (the trainer's side blocks in collectives); its result or error in box."""
    def go():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def joined(thread: threading.Thread, box: dict, what: str):
    thread.join()
    if "error" in box:
        raise CheckFailed(f"{what}: {first_line(box.pop('error'))}")
    return box.pop("result", None)


async def broadcast_version(ctx: Context, url: str, cfg, run, state: dict, files: Path) -> dict:
    """As tests/rl/test_broadcast.py drives it: the orchestrator's ServerPool and BroadcastDelivery
    on one side, the trainer's WeightBroadcaster on the other; then the same tensors from files."""
    import aiohttp

    from orchestrator.servers.delivery import BroadcastDelivery
    from orchestrator.servers.pool import ServerPool
    from rl.inference_api import InferenceClient, connector
    from rl.rundir import STABLE
    from trainer.broadcast import WeightBroadcaster

    ws, ids, box = cfg.weight_sync, prompts(ctx), {}
    async with aiohttp.ClientSession(connector=connector()) as s:
        client = InferenceClient(url, s)
        before = await greedy(client, ids)
        pool = ServerPool([url], s, None, 30,
                          lambda p: BroadcastDelivery(p, 300, None, False, ws.address, cfg.timeouts.broadcast_s))
        await pool.connect(60)
        thread = in_thread(lambda: WeightBroadcaster(cfg, run, tied=ctx.tied), box)
        await pool.delivery.prepare()
        broadcaster = await asyncio.to_thread(joined, thread, box, "forming the broadcast group")
        thread = in_thread(lambda: broadcaster.publish(1, state), box)
        while not (run.weights_dir(1) / STABLE).exists() and thread.is_alive():  # the orchestrator's cue
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        await pool.delivery.load(1, run.weights_dir(1))
        publish_s = await asyncio.to_thread(joined, thread, box, "publishing version 1")
        load_s = time.perf_counter() - started
        if pool.servers[0].version != 1:
            raise CheckFailed("the server did not take version 1 by broadcast", ctx.path / "server.log")
        by_broadcast = await greedy(client, ids)
        await client.update_weights(str(files), 2, "wait", 300)
        by_files = await greedy(client, ids)
        backend = broadcaster.group.backend_name
        broadcaster.close()
    return {"before": before, "by_broadcast": by_broadcast, "by_files": by_files, "publish_s": publish_s,
            "load_s": load_s, "backend": backend}


def check_broadcast(ctx: Context) -> tuple[str, dict]:
    from rl.config import RunConfig
    from rl.rundir import RunDir

    run = RunDir(ctx.path / "run")
    run.make()
    port, store = ctx.ports
    sync = {"weight_sync": {"kind": "broadcast", "address": f"127.0.0.1:{store}"},
            "timeouts": {"broadcast_s": 300 if ctx.gpu else 120}}
    cfg_file = write_config(ctx.path / "server.toml", ctx, run.root, sync, port=port)
    cfg = RunConfig.model_validate({"model": ctx.model, "output_dir": str(run.root), **sync})
    new = perturbed(model_tensors(ctx.model), seed=1)
    files = run.weights / "files"  # the same tensors as an HF directory, for the comparison
    write_model_copy(ctx.model, new, files)
    # What FSDP hands over: a tied model's lm_head is its embedding (the broadcaster drops it).
    embedding = new.get("model.embed_tokens.weight")
    state = {**new, "lm_head.weight": embedding} if ctx.tied and embedding is not None else new
    # On GPU the server takes the second GPU: trainer rank 0 (this process) keeps the first.
    with serving(ctx, cfg_file, port, "server", env=ctx.gpu_env(1, 1)):
        r = asyncio.run(broadcast_version(ctx, f"http://127.0.0.1:{port}", cfg, run, state, files))
    if r["by_broadcast"] == r["before"]:
        raise CheckFailed("greedy outputs did not change after the broadcast", ctx.path / "server.log")
    compare(r["by_broadcast"], r["by_files"], "broadcast vs file reload of the same tensors")
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    note = (f"{r['backend']}, {mb:.0f} MB: publish {r['publish_s']:.2f} s, update {r['load_s']:.2f} s; "
            "bit-exact with a file reload")
    return note, {"publish_s": r["publish_s"], "update_s": r["load_s"], "backend": r["backend"], "mb": mb}


# --- reload ----------------------------------------------------------------------------------------


async def reload_versions(ctx: Context, url: str, root: Path) -> dict:
    """The orchestrator's ServerPool and FileDelivery bring the server to versions 1 and 2 (POST
    /update_weights with weights/step_n relative to the run directory); greedy outputs before and
    after each."""
    import aiohttp

    from orchestrator.servers.delivery import FileDelivery
    from orchestrator.servers.pool import ServerPool
    from rl.inference_api import InferenceClient, connector
    from rl.rundir import RunDir

    run, ids, seconds, outputs = RunDir(root), prompts(ctx), [], {}
    async with aiohttp.ClientSession(connector=connector()) as s:
        client = InferenceClient(url, s)
        outputs[0] = await greedy(client, ids)
        pool = ServerPool([url], s, None, 30, lambda p: FileDelivery(p, 300, run.root, False))
        await pool.connect(60)
        for v in (1, 2):
            started = time.perf_counter()
            await pool.delivery.load(v, run.weights_dir(v))
            seconds.append(time.perf_counter() - started)
            if pool.servers[0].version != v:
                raise CheckFailed(f"the server did not reload version {v}", ctx.path / "server.log")
            outputs[v] = await greedy(client, ids)
    return {"outputs": outputs, "seconds": seconds}


def check_reload(ctx: Context) -> tuple[str, dict]:
    """One server, started on version 2's files (a fresh load), reloads version 1 then version 2:
    version 1 must change its outputs, and version 2 reloaded must answer bit for bit as the fresh
    load did (what a second server started on version 2 would show, at one server start)."""
    from rl.rundir import RunDir
    from trainer.weights import write_weights

    run = RunDir(ctx.path / "run")
    run.make()
    port, = ctx.ports
    base = model_tensors(ctx.model)
    for v in (1, 2):  # published as the trainer publishes them
        write_weights(run, v, perturbed(base, seed=v), Path(ctx.model), tied=ctx.tied)
    cfg = write_config(ctx.path / "server.toml", ctx, run.root, {}, port=port, model=str(run.weights_dir(2)))
    with serving(ctx, cfg, port, "server", env=ctx.gpu_env()):
        r = asyncio.run(reload_versions(ctx, f"http://127.0.0.1:{port}", run.root))
    fresh, one, two = (r["outputs"][v] for v in (0, 1, 2))
    if one == fresh:
        raise CheckFailed("greedy outputs did not change after reloading version 1", ctx.path / "server.log")
    compare(two, fresh, "version 2 reloaded vs version 2 loaded at start")
    first, warm = r["seconds"]
    note = f"reload {first:.2f} s (first after start), {warm:.2f} s (next); bit-exact with a fresh load"
    return note, {"first_reload_s": first, "reload_s": warm}
