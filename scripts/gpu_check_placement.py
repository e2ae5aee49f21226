"""The GPU check's items for issue 51's GPU path (scripts/gpu_check.py): the placement `rl run`
chooses on this machine's GPUs, the start on one GPU the server and the trainer share, and weight
reloads on vLLM's V2 model runner with per-token versions exact across an in-flight update.
Each needs a GPU (on CPU: SKIP), a GPU build of vLLM for the last two."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_items import CheckFailed, Context, last_line, rl_run, write_config
from gpu_check_serving import model_tensors, serving, write_model_copy


def expected_split(n: int) -> tuple[list[int], list[int]]:
    """What rl/gpu_placement.py promises for n GPUs with no gpus keys set."""
    if n == 1:
        return [0], [0]
    first = (n + 1) // 2
    return list(range(first)), list(range(first, n))


def check_placement(ctx: Context) -> tuple[str, dict]:
    """`rl run --dry-run` on every visible GPU: the plan it prints is the documented default."""
    cfg = write_config(ctx.path / "run.toml", ctx, ctx.path / "run", {})
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(ctx.visible)}
    done = subprocess.run([sys.executable, "-m", "asyncrl", "run", "@", str(cfg), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    log = ctx.path / "dry_run.log"
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise CheckFailed(f"rl run --dry-run exited {done.returncode}: {last_line(log)}", log)
    line = next((x for x in done.stderr.splitlines() if "GPU placement of" in x), None)
    inference, trainer = expected_split(len(ctx.visible))
    if line is None or f"server on GPU(s) {inference}" not in line or f"trainer on GPU(s) {trainer}" not in line:
        raise CheckFailed(f"expected server {inference}, trainer {trainer}; got: {line}", log)
    return line.removeprefix("rl run: "), {"inference": inference, "trainer": trainer}


def check_shared_gpu(ctx: Context) -> tuple[str, dict]:
    """A 2-step `rl run` on one GPU: the trainer starts only once the server serves (the item's
    scale gives the server 0.35 of the GPU, which the placement keeps), and both steps train."""
    root = rl_run(ctx, 2, {})
    log = ctx.path / "rl_run.log"
    text = log.read_text(errors="replace")
    if "the server serves: started trainer" not in text:
        raise CheckFailed("the launcher did not hold the trainer back until the server served", log)
    return "the trainer started once the server served (its KV cache sized); 2 steps trained", {"run": str(root)}


def zeroed_copy(ctx: Context, dest: Path) -> Path:
    """The model with every weight zero: its logits are all equal, so greedy decoding writes token 0."""
    tensors = {name: t.zero_() for name, t in model_tensors(ctx.model).items()}
    write_model_copy(ctx.model, tensors, dest)
    return dest


async def across_update(url: str, zeros: Path, n: int, max_tokens: int) -> tuple[list, dict]:
    """n greedy requests of max_tokens running when the zeroed weights load as version 1 ("keep")."""
    import aiohttp

    from rl.inference_api import GenerateRequest, InferenceClient, UpdateWeightsRequest, connector

    async with aiohttp.ClientSession(connector=connector()) as s:
        client = InferenceClient(url, s)
        body = GenerateRequest(request_id=f"v2-{time.monotonic_ns()}", prompt_token_ids=[1, 2, 3], n=n,
                               max_tokens=max_tokens, temperature=0)
        generating = asyncio.create_task(client.call("generate", 300, body))
        await asyncio.sleep(0.5)  # every request admitted and decoding
        update = await client.call("update_weights", 300, UpdateWeightsRequest(path=str(zeros), version=1,
                                                                               mode="keep"))
        return (await generating).samples, update.model_dump()


def check_reload_v2(ctx: Context) -> tuple[str, dict]:
    """An in-flight update on vLLM's V2 model runner with async scheduling (a GPU build's defaults):
    every token the zeroed weights wrote is tagged version 1, every one before version 0."""
    zeros = zeroed_copy(ctx, ctx.path / "run" / "weights" / "zeros")
    cfg = write_config(ctx.path / "server.toml", ctx, ctx.path / "run", {})
    env = {**ctx.gpu_env(), "VLLM_USE_V2_MODEL_RUNNER": "1"}
    port = ctx.ports[0]
    with serving(ctx, cfg, port, "server", env=env):
        samples, update = asyncio.run(across_update(f"http://127.0.0.1:{port}", zeros, 8, 400))
    log = ctx.path / "server.log"
    mixed = 0
    for sample in samples:
        versions, tokens = sample.versions, sample.token_ids
        if versions != sorted(versions) or set(versions) - {0, 1}:
            raise CheckFailed(f"versions not a 0...0 1...1 run: {versions}", log)
        if any(t != 0 for t, v in zip(tokens, versions) if v == 1):
            raise CheckFailed("a token tagged version 1 was not written by the zeroed weights", log)
        mixed += len(set(versions)) == 2
    if not mixed:
        raise CheckFailed(f"no request ran across the update (switched {update.get('switched')})", log)
    return f"{mixed} of {len(samples)} requests switched mid-way, every token's version exact", {"mixed": mixed}
