"""`rl eval @ cfg.toml [--step N[,M...]]`: evaluate a run's published weights (weights/step_N) or,
without --step (or as step 0), the config's model, on the config's [orchestrator.eval] datasets,
standalone: it starts its own inference server (`rl inference`, as a child process), runs the same
evaluation a training run runs (orchestrator/evaluation/held_out.py) for each step in turn, prints it,
appends one record per step to <output_dir>/evals.jsonl and stops the server. Greedy evaluation of
the same weights gives the same numbers every time.

Several steps share one server: it starts on the first step's weights and reloads each next one
(the same reload a training run uses), so a run's checkpoints are compared for the cost of one
engine start, not one each.

The server's run directory is a scratch directory under <output_dir>/eval/, so that an
orchestrator still training in <output_dir> does not find it and send it rollouts. Weights it
loads after starting must lie in its own run's weights/ (the only root a server accepts besides
its model), so each step is linked there (hard links: no copy of the bytes where the filesystem
allows). A LoRA run's step is an adapter: the server starts on the base model and loads each
step's adapter by name; step 0 is the base model itself.

`rl eval --follow` is the generation evaluation beside a run still training (`rl sft` with
sft.eval_generate starts it): step 0, then each version the run publishes as it appears, until
the last, each record appended to the run's metrics.jsonl (program "eval"), where the run's plots
and trackers find it.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from orchestrator.bounded_wait import HEARTBEAT_S
from orchestrator.evaluation.held_out import Evaluation
from orchestrator.prompts import configured_sources
from orchestrator.rendering import load_tokenizer
from orchestrator.rewards import configured_rewards
from orchestrator.rollout import Rollouts
from rl.config import RunConfig
from rl.faults import crash_point
from rl.inference_api import InferenceClient, InferenceError
from rl.rundir import STABLE, RunDir
from rl.stop_signal import die_with_parent, raise_on_sigterm

log = logging.getLogger("orchestrator")


def weights_for(cfg: RunConfig, step: int | None) -> Path:
    if step is None:
        return Path(cfg.model)
    weights = RunDir(cfg.run_dir).weights_dir(step)
    if not (weights / STABLE).exists():
        raise FileNotFoundError(f"--step {step}: {weights} holds no complete weights (no {STABLE})")
    return weights


async def evaluate(cfg: RunConfig, url: str, proc: subprocess.Popen, steps: list[int], scratch: RunDir,
                   lora: bool) -> list[dict]:
    """One record per step: the server already serves steps[0] (full fine-tuning) or the base
    model (LoRA); each next step is reloaded, or its adapter loaded, from `scratch`'s weights/."""
    async with aiohttp.ClientSession() as session:
        client, evaluation = await _evaluator(cfg, url, proc, session)
        return [await _one(cfg, client, evaluation, scratch, lora, step, reload=i > 0) for i, step in enumerate(steps)]


async def follow(cfg: RunConfig, url: str, proc: subprocess.Popen, scratch: RunDir, lora: bool, parent: int) -> int:
    """`--follow`: step 0 (the model the server started on), then every version the run in
    cfg.run_dir publishes, in order, until weights/step_{max_steps}; each record appended to the
    run's metrics.jsonl as soon as it is made. Each version is linked into `scratch` the moment it
    is complete, before the trainer's keep_weights can prune it. 1 when `parent` (rl sft, which
    started this process) is gone: PR_SET_PDEATHSIG says so first, this is the fallback."""
    run = RunDir(cfg.run_dir)
    linked: set[int] = set()
    done, waited_since = None, time.monotonic()
    async with aiohttp.ClientSession() as session:
        client, evaluation = await _evaluator(cfg, url, proc, session)
        while done is None or done < cfg.max_steps:
            for step in run.stable_weight_steps():
                if step not in linked and (done is None or step > done):
                    with contextlib.suppress(FileNotFoundError):  # pruned already: nothing to evaluate
                        shutil.copytree(run.weights_dir(step), scratch.weights_dir(step), copy_function=_link_or_copy)
                        linked.add(step)
            step = 0 if done is None else min((s for s in linked if s > done), default=None)
            if step is None:
                if os.getppid() != parent:
                    log.error("rl eval --follow: the process that started it is gone; stopping")
                    return 1
                if time.monotonic() - waited_since > HEARTBEAT_S:
                    log.info("waiting for weights after step %d (of %d) in %s", done, cfg.max_steps, run.weights)
                    waited_since = time.monotonic()
                await asyncio.sleep(0.5)
                continue
            record = await _one(cfg, client, evaluation, scratch, lora, step, reload=step > 0)
            run.append_metrics(record)
            log.info("step %d: %s", step, _summary(record))
            crash_point("eval.recorded", step)
            shutil.rmtree(scratch.weights_dir(step), ignore_errors=True)
            done, waited_since = step, time.monotonic()
    return 0


async def _evaluator(cfg: RunConfig, url: str, proc: subprocess.Popen,
                     session: aiohttp.ClientSession) -> tuple[InferenceClient, Evaluation]:
    client = InferenceClient(url, session, cfg.inference.api_token)
    await _until_answering(cfg, client, proc)
    sources = configured_sources(cfg, evaluation=True)
    rollouts = Rollouts(cfg, load_tokenizer(str(cfg.model)), {}, None, None)
    rewards = configured_rewards(cfg, session, evaluation=True)
    return client, Evaluation(rollouts, sources, cfg.orchestrator.eval, rewards, cfg.orchestrator.timeouts.eval_s)


async def _one(cfg: RunConfig, client: InferenceClient, evaluation: Evaluation, scratch: RunDir, lora: bool,
               step: int, reload: bool) -> dict:
    """Step `step` evaluated: full fine-tuning reloads its weights (unless the server started on
    them, reload=False); LoRA loads its adapter by name (step 0: the base model itself)."""
    name, timeout = None, cfg.inference.timeouts.reload_s
    if lora and step:
        name = f"eval-v{step}"
        await client.load_lora_adapter(name, str(scratch.weights_dir(step).absolute()), step, timeout)
    elif reload:
        await client.update_weights(str(scratch.weights_dir(step).absolute()), step, "wait", timeout)
    record = await evaluation.run(client, step, step, f"eval-{step}", name)
    if name is not None:
        await client.unload_lora_adapter(name)
    return record


async def _stoppable(work):
    """`work`, cancelled by SIGTERM through the loop's own handler: a stop inside an await unwinds
    as a cancel, not as an exception raised between two bytecodes of whatever was running."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    return await work


def _summary(record: dict) -> str:
    return ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" if isinstance(v, float) else f"{k.removeprefix('eval/')} {v}"
                     for k, v in record.items() if k.startswith("eval/"))


async def _until_answering(cfg: RunConfig, client: InferenceClient, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + cfg.orchestrator.timeouts.server_wait_s
    while not await _answers(client):
        if proc.poll() is not None:
            raise RuntimeError(f"the inference server exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the inference server did not answer within "
                               f"{cfg.orchestrator.timeouts.server_wait_s:.0f} s")
        await asyncio.sleep(1.0)


async def _answers(client: InferenceClient) -> bool:
    try:
        await client.health(timeout=2.0)
        return True
    except InferenceError:
        return False


def main(cfg: RunConfig, argv: list[str], steps: list[int], following: bool = False) -> int:
    """`steps`: the steps to evaluate, 0 for the config's model ([0] without --step). `following`:
    instead, every step the run publishes until its last (`follow`)."""
    parent = os.getppid()  # at once: rl sft may die while the server starts
    if not cfg.orchestrator.eval.datasets and not cfg.orchestrator.eval.environments:
        log.error("rl eval: no [[orchestrator.eval.datasets]] or [[orchestrator.eval.environments]] in the config: "
                  "nothing to evaluate")
        return 2
    steps = sorted(set(steps))
    try:
        weights = {} if following else {step: weights_for(cfg, step or None) for step in steps}
    except FileNotFoundError as e:
        log.error("rl eval: %s", e)
        return 2
    lora = bool(cfg.trainer.lora.rank)
    scratch, served = _scratch_run(cfg, steps, weights, lora, following)
    log_file = scratch.root / "inference.log"
    # SIGTERM (rl sft stopping, or dying: its PR_SET_PDEATHSIG) unwinds to the finally below, which
    # stops the server: it runs in a session of its own, which a signal to this group misses. In
    # the event loop it cancels the evaluation instead (_stoppable).
    raise_on_sigterm(lambda: KeyboardInterrupt())
    proc = None
    try:
        with open(log_file, "ab") as out:
            # SIGTERMed if this process dies, even by SIGKILL: no engine outlives its evaluation.
            proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "inference", *argv, "--model",
                                     str(served.absolute()), "--output_dir", str(scratch.root)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=die_with_parent)
        if following:
            code = asyncio.run(_stoppable(follow(cfg, cfg.inference.url, proc, scratch, lora, parent)))
            shutil.rmtree(scratch.root, ignore_errors=True)
            return code
        records = asyncio.run(_stoppable(evaluate(cfg, cfg.inference.url, proc, steps, scratch, lora)))
    except (RuntimeError, TimeoutError, InferenceError) as e:
        log.error("rl eval: %s; last lines of %s:\n%s", e, log_file, log_file.read_text(errors="replace")[-2000:])
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):
        log.error("rl eval: stopped")
        return 1
    finally:
        if proc is not None:
            _stop(proc)
    _report(cfg, steps, records, weights)
    shutil.rmtree(scratch.root, ignore_errors=True)
    return 0


def _scratch_run(cfg: RunConfig, steps: list[int], weights: dict[int, Path], lora: bool,
                 following: bool) -> tuple[RunDir, Path]:
    """The evaluation server's own run directory, holding the steps it loads as versions (linked
    where it can), and the model it starts from: the first full step, served as the model itself,
    or the config's model for adapters and for a followed run."""
    scratch = RunDir(Path(cfg.output_dir) / "eval" / f"server-{os.getpid()}")
    scratch.root.mkdir(parents=True, exist_ok=True)
    for step in steps[0 if lora else 1:]:
        if step and not following:
            shutil.copytree(weights[step], scratch.weights_dir(step), copy_function=_link_or_copy)
    return scratch, Path(cfg.model) if lora or following else weights[steps[0]]


def _report(cfg: RunConfig, steps: list[int], records: list[dict], weights: dict[int, Path]) -> None:
    """One line per step in evals.jsonl (with the weights it read), and the eval/ figures printed."""
    with open(Path(cfg.output_dir) / "evals.jsonl", "a") as f:
        for step, record in zip(steps, records):
            f.write(json.dumps({**record, "weights": str(weights[step])}) + "\n")
    for step, record in zip(steps, records):
        if len(steps) > 1:
            print(f"step {step}:")
        for key, value in record.items():
            if key.startswith("eval/"):
                print(f"{key.removeprefix('eval/')}: {value:.4f}" if isinstance(value, float) else f"{key[5:]}: {value}")


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (the step's bytes are not copied), or a copy where the filesystem refuses one."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


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
