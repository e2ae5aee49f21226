"""The orchestrator in a scenario a test dictates: stand-in servers (tests/fake_inference.py) and a
stand-in trainer that publishes a version per batch, run under a timeout; the outcome (batches,
checkpoints, log lines) and the rules every scenario must keep (check_rules). Shared by the
scheduling, flaky-service, failing-episode, footprint and engine-stall tests."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from hypothesis import strategies as st

from conftest import TINY_MODEL, free_port
from fake_inference import FakeServer, row_name, start
from orchestrator.orchestrator import Orchestrator
from orchestrator.prompts.queue import decode_state
from rl.batch import Batch
from rl.config import RunConfig
from rl.inference_api import connector
from rl.rundir import RunDir, mark_stable


NAMES = {row_name(i): i for i in range(5000)}


@dataclass
class Outcome:
    cfg: RunConfig
    run: RunDir
    handover_versions: dict[int, list[int]]
    handed_over_at: dict[int, float]
    """time.monotonic() at which each batch left."""
    batches: dict[int, Batch]
    metrics: list[dict]
    orchestrator: Orchestrator
    warnings: list[str]


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def fake_trainer(run: RunDir, steps: int, step_latency, first: int = 1) -> None:
    """Consumes batch n, then publishes version n (an empty weights directory marked STABLE:
    the stand-in servers load nothing)."""
    for n in range(first, steps + 1):
        while not run.rollout_dir(n).exists():
            await asyncio.sleep(0.002)
        delay = step_latency()  # seconds, or something to await
        await (delay if inspect.isawaitable(delay) else asyncio.sleep(delay))
        d = run.weights_dir(n)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"")
        mark_stable(d)


# The scenarios' dataset: fake_inference's rows, scored by its reward.
DATASET = {"name": "data", "function": "fake_inference:dataset", "reward": "fake_inference:reward"}


def make_config(root: Path, ports: list[int], **overrides) -> RunConfig:
    orchestrator = {
        "servers": {"urls": [f"http://127.0.0.1:{p}" for p in ports]},
        "datasets": [DATASET],
        "scheduling": {"prompts_per_step": 4, "group_size": 2, "max_in_flight_groups": 10, "poll_interval_s": 0.005},
        "sampling": {"max_tokens": 6}, "timeouts": {"request_s": 30, "weights_s": 30},
    }
    # A table's keys join its defaults here; other keys replace them.
    for key, value in overrides.pop("orchestrator", {}).items():
        orchestrator[key] = {**orchestrator[key], **value} if isinstance(value, dict) and key in orchestrator else value
    return RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(root), "seq_len": 64,
                                     "max_steps": 6, **overrides, "orchestrator": orchestrator})


async def run_scenario(root: Path, servers: list[FakeServer], step_latency=lambda: 0.0,
                       timeout_s: float = 60, on_start=None, **overrides) -> Outcome:
    """`on_start(orchestrator)`: called once it exists, before it runs."""
    ports = [free_port() for _ in servers]
    runners = [await start(s, p) for s, p in zip(servers, ports)]
    cfg = make_config(root, ports, **overrides)
    run = RunDir(root)
    run.make()
    first = max(run.rollout_steps(), default=0) + 1
    handovers: dict[int, list[int]] = {}
    handed_over_at: dict[int, float] = {}
    warnings = Collect()
    logging.getLogger("orchestrator").addHandler(warnings)
    try:
        async with aiohttp.ClientSession(connector=connector()) as session:
            orch = Orchestrator(cfg, session)
            send = orch.sender.send

            async def observed_send(batch: Batch, timeout_s: float, *encoded) -> None:
                # What every server in rotation really serves at the moment the batch leaves
                # (one out of rotation gets no requests, so serves this run nothing).
                handovers[batch.step] = [fake.version for fake, s in zip(servers, orch.pool.servers) if s.healthy]
                handed_over_at[batch.step] = time.monotonic()
                await send(batch, timeout_s, *encoded)

            orch.sender.send = observed_send
            if on_start is not None:
                on_start(orch)
            trainer = asyncio.create_task(fake_trainer(run, cfg.max_steps, step_latency, first))
            try:
                await asyncio.wait_for(orch.run(), timeout_s)
                await asyncio.wait_for(trainer, timeout_s)
            finally:
                trainer.cancel()
    finally:
        logging.getLogger("orchestrator").removeHandler(warnings)
        for r in runners:
            await r.cleanup()
    batches = {n: Batch.read(run.rollout_dir(n)) for n in run.rollout_steps()}
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    return Outcome(cfg, run, handovers, handed_over_at, batches, metrics, orch, warnings.lines)


def prompt_indices(batch: Batch, tokenizer) -> list[int]:
    """Dataset index of each group in the batch (samples of a group share their prompt)."""
    out = []
    for s in batch.sample_slices():
        mask = batch.loss_mask[s]
        prompt = batch.tokens[s][: int(mask.argmax())].tolist()
        out.append(NAMES[tokenizer.decode(prompt).rstrip("=")])
    return out


def check_rules(o: Outcome, every_prompt_batched_or_pending: bool = True) -> None:
    k, m = o.cfg.max_async_level, o.cfg.off_policy_steps
    assert sorted(o.batches) == list(range(1, o.cfg.max_steps + 1))
    for n, versions in o.handover_versions.items():
        assert min(versions) >= n - 1 - k, f"batch {n} handed over while serving {versions} (k={k})"
    for n, batch in o.batches.items():
        sampled = batch.token_versions[batch.loss_mask == 1]
        assert sampled.min() >= n - 1 - m, f"batch {n} holds a token of version {sampled.min()} (m={m})"
        assert sampled.max() <= n - 1, f"batch {n} holds a token newer than version {n - 1}"
        assert batch.num_samples == o.cfg.orchestrator.scheduling.prompts_per_step * o.cfg.orchestrator.scheduling.group_size
    if not o.cfg.orchestrator.eval.datasets:  # none configured: none run, none fail
        assert not [r for r in o.metrics if r.get("program") == "eval"]
        assert not [w for w in o.warnings if "evaluation" in w], o.warnings
    # Nothing lost, nothing used twice.
    tokenizer = o.orchestrator.rollouts.tokenizer
    used = [i for b in o.batches.values() for i in set(prompt_indices(b, tokenizer))]
    assert len(used) == len(set(used)), "a prompt went into two batches"
    last = o.run.checkpoint_steps("orchestrator")[-1]
    directory = o.run.checkpoint_dir(last) / "orchestrator"
    step, cursor, pending, _ = decode_state((directory / "state.json").read_bytes())
    pending_ids = [p.index for p in pending]
    assert step == o.cfg.max_steps
    # The last checkpoint holds the very batch it was written for.
    assert Batch.read(directory / "batch").encode() == o.batches[step].encode()
    assert not set(pending_ids) & set(used)
    assert set(used + pending_ids) <= set(range(cursor))
    if every_prompt_batched_or_pending:  # unless groups were filtered out on purpose
        assert sorted(used + pending_ids) == list(range(cursor)), "a drawn prompt is neither batched nor pending"


latencies = st.sampled_from(["uniform", "exponential", "long_tail"])


async def copying_trainer(run: RunDir, steps: int) -> None:
    """Consumes batch n, then publishes version n: the starting model's files again."""
    for n in range(1, steps + 1):
        while not run.rollout_dir(n).exists():
            await asyncio.sleep(0.002)
        staging = run.weights / f".step_{n}"
        shutil.copytree(TINY_MODEL, staging)
        mark_stable(staging)
        staging.rename(run.weights_dir(n))
