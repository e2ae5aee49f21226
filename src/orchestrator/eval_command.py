"""`rl eval @ cfg.toml [--step N]`: evaluate a run's published weights (weights/step_N) or, without
--step, the config's model, on the config's [orchestrator.eval] datasets, standalone: it starts
its own inference server on those weights (`rl inference`, as a child process), runs the same
evaluation a training run runs (orchestrator/evaluation.py), prints it, appends it to
<output_dir>/evals.jsonl and stops the server. Greedy evaluation of the same weights gives the
same numbers every time.

The server's run directory is a scratch directory under <output_dir>/eval/, so that an
orchestrator still training in <output_dir> does not find it and send it rollouts. A LoRA run's
step is an adapter: the server starts on the base model, and the adapter is copied into the
scratch run's weights/ (the only adapter root a server accepts, and a few MB) and loaded there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from orchestrator.evaluation import Evaluation
from orchestrator.rollouts import Rollouts
from orchestrator.sources import configured_sources
from orchestrator.tokenizer import load_tokenizer
from rl.config import RunConfig
from rl.inference_api import InferenceClient, InferenceError
from rl.rundir import STABLE, RunDir

log = logging.getLogger("orchestrator")


def weights_for(cfg: RunConfig, step: int | None) -> Path:
    if step is None:
        return Path(cfg.model)
    weights = RunDir(cfg.run_dir).weights_dir(step)
    if not (weights / STABLE).exists():
        raise FileNotFoundError(f"--step {step}: {weights} holds no complete weights (no {STABLE})")
    return weights


async def evaluate(cfg: RunConfig, url: str, version: int, proc: subprocess.Popen, adapter: Path | None) -> dict:
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(url, session, cfg.inference.api_token)
        deadline = time.monotonic() + cfg.orchestrator.server_wait_timeout_s
        while not await _answers(client):
            if proc.poll() is not None:
                raise RuntimeError(f"the inference server exited with code {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the inference server did not answer within {cfg.orchestrator.server_wait_timeout_s:.0f} s")
            await asyncio.sleep(1.0)
        sources = configured_sources(cfg, session, evaluation=True)
        name = None
        if adapter is not None:
            name = f"eval-v{version}"
            await client.load_lora_adapter(name, str(adapter), version, cfg.inference.reload_timeout_s)
        rollouts = Rollouts(cfg, load_tokenizer(str(cfg.model)), {}, None, None)
        return await Evaluation(rollouts, sources, cfg.orchestrator.eval).run(client, version, version, "eval", name)


async def _answers(client: InferenceClient) -> bool:
    try:
        await client.health(timeout=2.0)
        return True
    except InferenceError:
        return False


def main(cfg: RunConfig, argv: list[str], step: int | None) -> int:
    if not cfg.orchestrator.eval.datasets:
        log.error("rl eval: no [[orchestrator.eval.datasets]] in the config: nothing to evaluate")
        return 2
    try:
        weights = weights_for(cfg, step)
    except FileNotFoundError as e:
        log.error("rl eval: %s", e)
        return 2
    scratch = Path(cfg.output_dir) / "eval" / f"server-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    log_file = scratch / "inference.log"
    served, adapter = weights, None
    if cfg.trainer.lora.rank and step is not None:
        served, adapter = Path(cfg.model), RunDir(scratch).weights_dir(step)
        shutil.copytree(weights, adapter)
    with open(log_file, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rl", "inference", *argv, "--model", str(served.absolute()),
                                 "--output_dir", str(scratch)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        record = asyncio.run(evaluate(cfg, cfg.inference.url, step or 0, proc, adapter and adapter.absolute()))
    except (RuntimeError, TimeoutError, InferenceError) as e:
        log.error("rl eval: %s; last lines of %s:\n%s", e, log_file, log_file.read_text(errors="replace")[-2000:])
        return 1
    finally:
        _stop(proc)
    record = {**record, "weights": str(weights)}
    with open(Path(cfg.output_dir) / "evals.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    for key, value in record.items():
        if key.startswith("eval/"):
            print(f"{key.removeprefix('eval/')}: {value:.4f}" if isinstance(value, float) else f"{key[5:]}: {value}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:  # vLLM's engine processes, whatever is left of the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
