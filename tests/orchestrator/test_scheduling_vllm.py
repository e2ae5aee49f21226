"""The scheduling rules of tests/orchestrator/test_scheduling.py, against two real vLLM servers
(`rl inference`) instead of stand-ins: the hand-over rule (no batch n leaves before version
n-1-k serves on every server, as each server itself reports on /health), the staleness bound on
every token, in-flight updates end to end (per-token versions from the engine, in order within
a sample, samples straddling an update; none with "wait" updates), and prompt accounting
(each prompt drawn is in one batch or pending, none in two). The trainer is a stand-in that
publishes a copy of the model's files as each version, so every update is a real reload.
And on-policy distillation with a real teacher engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path

import aiohttp
import pytest

from conftest import TINY_MODEL
from float32_rounding import float64_logprobs
from orchestrator.orchestrator import Orchestrator
from rl.batch import Batch
from rl.rundir import RunDir
from programs import launch_server, wait_healthy
from scenarios import Collect, Outcome, check_rules, copying_trainer, make_config
from rl.inference_api import connector

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server_pair(tmp_path_factory):
    """Two servers for the module, on one run directory (the orchestrator names weights relative
    to it, and a server loads only from its own run's weights/)."""
    tmp = tmp_path_factory.mktemp("servers")
    launched = [launch_server(tmp, f"server{i}", TINY_MODEL, tmp / "run") for i in range(2)]
    try:
        for proc, url in launched:
            wait_healthy(proc, url)
        yield tmp / "run", [url for _, url in launched]
    finally:
        for proc, _ in launched:
            proc.stop()


@pytest.fixture
def servers(server_pair) -> tuple[Path, list[str]]:
    """The run directory, emptied but for the servers' own heartbeats, and the two URLs: each
    test starts at step 1, and the orchestrator loads version 0 (the base model) back onto
    servers an earlier test left on another version."""
    run, urls = server_pair
    for child in run.iterdir():
        if child.name != "heartbeats":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    return run, urls


async def real_scenario(root: Path, urls: list[str], in_flight: bool) -> Outcome:
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    cfg = make_config(root, ports, max_steps=12, max_async_level=1, orchestrator={
        "sampling": {"max_tokens": 40, "temperature": 1.0},
        "scheduling": {"in_flight_updates": in_flight, "max_off_policy_steps": 1, "group_size": 2,
                       "prompts_per_step": 4, "max_in_flight_groups": 10},
        "timeouts": {"request_s": 60, "weights_s": 120}})
    run = RunDir(root)
    run.make()
    handovers: dict[int, list[int]] = {}
    handed_over_at: dict[int, float] = {}
    warnings = Collect()
    logging.getLogger("orchestrator").addHandler(warnings)
    try:
        async with aiohttp.ClientSession(connector=connector()) as session:
            orch = Orchestrator(cfg, session)
            send = orch.sender.send

            async def health(url: str) -> int:
                async with session.get(f"{url}/health") as r:
                    return (await r.json())["version"]

            async def observed_send(batch: Batch, timeout_s: float, *encoded) -> None:
                # What each server in rotation says it serves, asked before the batch can
                # leave (an update finishing during the question only raises the number it
                # reports, which the rule allows; nothing else is sent while send waits).
                handovers[batch.step] = [await health(s.url) for s in orch.pool.servers if s.healthy]
                handed_over_at[batch.step] = time.monotonic()
                await send(batch, timeout_s, *encoded)

            orch.sender.send = observed_send
            trainer = asyncio.create_task(copying_trainer(run, cfg.max_steps))
            try:
                await asyncio.wait_for(orch.run(), 240)
                await asyncio.wait_for(trainer, 60)
            finally:
                trainer.cancel()
    finally:
        logging.getLogger("orchestrator").removeHandler(warnings)
    batches = {n: Batch.read(run.rollout_dir(n)) for n in run.rollout_steps()}
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    return Outcome(cfg, run, handovers, handed_over_at, batches, metrics, orch, warnings.lines)


def straddling(o: Outcome) -> int:
    """Samples whose tokens carry two versions; each sample's versions never go back."""
    count = 0
    for b in o.batches.values():
        for s in b.sample_slices():
            v = b.token_versions[s][b.loss_mask[s] == 1]
            assert (v[1:] >= v[:-1]).all(), v
            count += int(v.min() != v.max())
    return count


def test_the_rules_hold_on_real_servers_with_in_flight_updates(servers):
    o = asyncio.run(real_scenario(*servers, in_flight=True))
    check_rules(o)
    assert all(len(v) == 2 for v in o.handover_versions.values()), o.handover_versions  # both in rotation
    # Updates land while requests run (each batch's version reaches servers generating the next
    # groups), so some samples straddle one: per-token versions as the engine recorded them.
    assert straddling(o) > 0
    # Every version was served by every server: each reloaded for real, 11 times.
    assert max(v for vs in o.handover_versions.values() for v in vs) >= o.cfg.max_steps - 2


def test_with_wait_updates_no_sample_straddles_a_version_on_real_servers(servers):
    o = asyncio.run(real_scenario(*servers, in_flight=False))
    check_rules(o)
    assert straddling(o) == 0


def perturbed_copy(out: Path, seed: int = 0) -> None:
    """The tiny model's files with every matrix moved by 30% of its own spread in random
    directions: a teacher whose logprobs are its own, different per token and from the
    student's."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(TINY_MODEL, out)
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        if t.dim() == 2:
            t.add_(torch.randn(t.shape, generator=g) * 0.3 * t.std())
    save_file(tensors, out / "model.safetensors")


def teacher_reference(path: Path, tokens: list[int]):
    """(log_softmax over the vocabulary at every position, float64, [len(tokens), vocab]; per
    position, how far float32 rounding may move any of its logits: tests/float32_rounding.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    return float64_logprobs(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).double().eval(), tokens)


def test_a_real_teacher_scores_the_students_real_tokens(servers):
    """On-policy distillation with both models on real engines: server 0 is the student (the
    tiny model), server 1 becomes the teacher by a real reload of a perturbed copy of it, whose
    logprobs differ per token and from the student's. Each model token's advantage is
    teacher.coef * (the teacher's logprob of that token at that position - the student's
    sampled logprob), the teacher's logprob as the teacher model itself computes it
    (transformers, float64, over the sample's own token ids) to within float32 rounding; the
    prompt's tokens get none. The comparison is sharp enough to see the teacher scored at a
    position shifted by one, or another token's logprob: both are checked to fall outside it."""
    from orchestrator.prompts.queue import Prompt
    from orchestrator.rollout.groups import Rollouts
    from orchestrator.rewards.reward import Teacher
    from orchestrator.prompts.dataset_mix import Source
    from orchestrator.rendering.tokenizer import load_tokenizer
    from rl.config import RunConfig
    from rl.inference_api import InferenceClient

    run, (student_url, teacher_url) = servers
    teacher_dir = RunDir(run).weights_dir(1)
    perturbed_copy(teacher_dir)
    coef = 0.5
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 64, "orchestrator": {
        "scheduling": {"group_size": 4}, "sampling": {"max_tokens": 12},
        "datasets": [{"name": "data", "function": "tasks.reverse:dataset"}],  # no reward: the teacher alone
        "teacher": {"url": teacher_url, "coef": coef}}})

    async def scenario():
        async with aiohttp.ClientSession(connector=connector()) as session:
            async with session.post(f"{teacher_url}/update_weights",
                                    json={"path": str(teacher_dir), "version": 1, "mode": "wait"}) as r:
                assert r.status == 200, await r.text()
            student, teacher = InferenceClient(student_url, session), InferenceClient(teacher_url, session)
            sources = {d.name: Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets()}
            rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), sources, Teacher(teacher, coef, 60), None)
            return await rollouts.group(Prompt(0, {"prompt": "abc="}), "g", lambda req: student.generate(req, 60))

    group = asyncio.run(scenario())
    vocab = json.loads((TINY_MODEL / "config.json").read_text())["vocab_size"]
    compared = shifted_seen = wrong_seen = 0
    teacher_lps = []
    for s in group.samples:
        model = [i for i, m in enumerate(s.loss_mask) if m]
        assert model and model[0] > 0, "the student sampled no token"
        assert all(s.advantages[i] == 0 for i, m in enumerate(s.loss_mask) if not m)
        lp, bounds = teacher_reference(teacher_dir, s.tokens)
        for i in model:
            # Token i is scored by the logits at position i - 1; the student's logprob is exact
            # (the batch holds what the student engine returned), so the advantage is off by
            # coef times the teacher logprob's float32 error at most.
            tol = coef * 2 * float(bounds[i - 1])
            teacher_lp = float(lp[i - 1, s.tokens[i]])
            teacher_lps.append(teacher_lp)
            assert abs(s.advantages[i] - coef * (teacher_lp - s.logprobs[i])) <= tol, \
                (i, s.tokens[i], s.advantages[i], coef * (teacher_lp - s.logprobs[i]), tol)
            compared += 1
            # What a teacher scored one position off, or at another token, would have given.
            if i >= 2:
                shifted_seen += abs(s.advantages[i] - coef * (float(lp[i - 2, s.tokens[i]]) - s.logprobs[i])) > tol
            other = (s.tokens[i] + 1) % vocab
            wrong_seen += abs(s.advantages[i] - coef * (float(lp[i - 1, other]) - s.logprobs[i])) > tol
    assert compared >= len(group.samples)
    # Neither the teacher's logprobs nor the signal are flat (as a zeroed teacher's would be)...
    assert max(teacher_lps) - min(teacher_lps) > 0.5
    assert max(abs(a) for s in group.samples for a in s.advantages) > 0.1
    # ... and the bound is tight enough that most tokens would show either bug.
    assert shifted_seen > compared // 2 and wrong_seen > compared // 2, (shifted_seen, wrong_seen, compared)
