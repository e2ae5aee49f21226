"""Routed experts recorded by a real vLLM engine (inference.record_routing) on models/tiny-moe (a
4-expert top-2 Qwen3-MoE): /generate returns every position's experts per MoE layer, and a
transformers forward that replays them reproduces the engine's logprobs within float32 rounding,
more closely than one that routes by itself where routing differs. The trainer side (replay uses
exactly the record, the router's gradient, the batch layout): tests/trainer/test_routing_replay.py."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from conftest import ROOT
from float32_rounding import logit_error
from rl.inference_api import RoutedExperts
from trainer.routing_replay import RoutingReplay

MOE_MODEL = ROOT / "models" / "tiny-moe"
PROMPTS = ["abcdef:", "hello:", "qwerty:", "zyx:"]
# Per layer q/k/v, scores, values, o, router, experts' gate/up, down, their weighted sum.
MOE_LOGIT_ERROR = logit_error(9)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from programs import launch_server, wait_healthy

    tmp = tmp_path_factory.mktemp("routing")
    proc, url = launch_server(tmp, "inference", MOE_MODEL, tmp / "run", "record_routing = true\n")
    wait_healthy(proc, url)
    yield url
    proc.stop()


def prompt_ids() -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MOE_MODEL / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def sampled(server) -> list[tuple[list[int], dict, RoutedExperts]]:
    """(prompt, sample, its routing) for 8 samples at T = 1 of each prompt."""
    out = []
    for i, prompt in enumerate(prompt_ids()):
        r = httpx.post(f"{server}/generate", timeout=120, json={
            "request_id": f"route-{i}", "prompt_token_ids": prompt, "n": 8, "max_tokens": 10,
            "temperature": 1.0, "routed_experts": True})
        r.raise_for_status()
        for s in r.json()["samples"]:
            out.append((prompt, s, RoutedExperts(**s["routed_experts"])))
    return out


@pytest.fixture(scope="module")
def model64():
    from transformers import AutoModelForCausalLM

    # One thread for the replaying forwards: each is a few tiny matrix products, and torch's
    # default (a thread per core), next to the engine and the other workers on 2 cores, spends
    # far more in its threads' spin-waits than in them (measured: 0.3-1 s a forward on a loaded
    # machine against 0.015-0.02 s on one thread). Float64 either way: the bounds the tests
    # compare with are float32 rounding's. Restored for the tests of other files on this worker.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # "eager" experts: torch's grouped matmul (transformers' default here) has no float64.
    yield AutoModelForCausalLM.from_pretrained(MOE_MODEL, dtype=torch.float64, experts_implementation="eager").eval()
    torch.set_num_threads(threads)


def test_every_position_the_engine_ran_has_its_experts(sampled):
    layers = 4  # models/tiny-moe: every one of its 4 layers is a mixture of experts
    for prompt, s, routing in sampled:
        rows = routing.array()
        # Prompt and sampled tokens but the last, which is never fed forward.
        assert routing.positions == len(prompt) + len(s["token_ids"]) - 1
        assert routing.layers == list(range(layers)) and routing.top_k == 2 and routing.missing == []
        assert rows.shape == (routing.positions, layers, 2)
        assert (rows < 4).all() and (rows[..., 0] != rows[..., 1]).all()  # two distinct of 4 experts


def replayed_logprobs(model, prompt: list[int], s: dict, routing: RoutedExperts | None, replay: bool):
    """(logprob of each sampled token, per token how far float32 rounding may move it) from a
    transformers forward over prompt + completion, routing replayed or not."""
    ids = prompt + s["token_ids"]
    n = len(ids)
    rows = torch.zeros(1, n, 4, 2, dtype=torch.long)
    routed = torch.zeros(1, n, dtype=torch.bool)
    if routing is not None:
        rows[0, :routing.positions] = torch.from_numpy(routing.array().astype(np.int64))
        routed[0, :routing.positions] = True
    hook = RoutingReplay(model, replay=replay)
    head_in = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, o: head_in.append(i[0][0]))
    try:
        with hook.recorded(rows, routed, routed), torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            bound = MOE_LOGIT_ERROR * (head.weight.abs() @ head_in[0].abs().T).max(0).values
    finally:
        handle.remove()
        hook.remove()
    at = torch.arange(len(prompt) - 1, n - 1)
    target = torch.tensor(ids[len(prompt):])
    metrics = hook.metrics(hook.take_sums().tolist())
    return lp[at, target], 2 * bound[at], metrics


def test_replaying_the_record_reproduces_the_engines_logprobs_within_rounding(sampled, model64):
    """A wrong row anywhere would send that position through other experts: its logprob, and those
    after it, would move by far more than rounding."""
    worst = 0.0
    for prompt, s, routing in sampled:
        lp, bound, metrics = replayed_logprobs(model64, prompt, s, routing, replay=True)
        error = (lp - torch.tensor(s["logprobs"], dtype=torch.float64)).abs()
        assert (error <= bound).all(), (s["token_ids"], error.tolist(), bound.tolist())
        worst = max(worst, float((error / bound).max()))
        assert metrics["routing_replayed_frac"] == 1.0
    # The bound is tight enough to catch one wrong row: the first sampled token's position sent
    # to the other two experts in one layer moves a logprob past it.
    prompt, s, routing = next(x for x in sampled if len(x[1]["token_ids"]) > 3)
    rows = routing.array().copy()
    rows[len(prompt), 1] = [e for e in range(4) if e not in rows[len(prompt), 1]]
    wrong = routing.model_copy(update={"data": base64.b64encode(rows.tobytes()).decode()})
    lp, bound, _ = replayed_logprobs(model64, prompt, s, wrong, replay=True)
    assert ((lp - torch.tensor(s["logprobs"], dtype=torch.float64)).abs() > bound).any()
    print(f"worst error / bound: {worst:.2e}")


def test_replay_is_closer_to_the_engine_than_routing_alone_where_routing_differs(sampled, model64):
    """A trainer whose routers moved (a version ahead of the sampler: here, noise on the router
    weights) picks other experts for some tokens; replaying the engine's record puts those back,
    and the logprobs come out nearer the engine's than the trainer's own routing gives."""
    import copy

    moved = copy.deepcopy(model64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in moved.model.layers:
            w = layer.mlp.gate.weight
            w.add_(0.2 * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype))
    own_error = replay_error = 0.0
    agreement = []
    for prompt, s, routing in sampled:
        engine = torch.tensor(s["logprobs"], dtype=torch.float64)
        own, _, metrics = replayed_logprobs(moved, prompt, s, routing, replay=False)
        replayed, _, _ = replayed_logprobs(moved, prompt, s, routing, replay=True)
        own_error += float((own - engine).abs().sum())
        replay_error += float((replayed - engine).abs().sum())
        agreement.append(metrics["routing_agreement"])
    assert min(agreement) < 1.0  # the moved routers do route some tokens elsewhere
    assert replay_error < own_error, (replay_error, own_error)
    print(f"agreement {np.mean(agreement):.3f}; |logprob error| summed: own routing {own_error:.3f}, "
          f"replayed {replay_error:.3f}")


def greedy(url: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(prompt_ids()):
        r = httpx.post(f"{url}/generate", timeout=120, json={
            "request_id": f"greedy-{i}-{len(out)}", "prompt_token_ids": prompt, "max_tokens": 10,
            "temperature": 0.0})
        r.raise_for_status()
        s = r.json()["samples"][0]
        out.append((s["token_ids"], s["logprobs"]))
    return out


def test_a_reloaded_moe_engine_answers_exactly_as_before(server):
    """vLLM 0.32's CPU MoE kernel computes from experts packed at load; its reload copied unpacked
    weights into that layout (reloading the same weights changed the greedy answers here) until
    the worker re-packs them (inference/worker_extension.py repack_cpu_experts)."""
    before = greedy(server)
    r = httpx.post(f"{server}/update_weights", timeout=120, json={"path": "base", "version": 1})
    r.raise_for_status()
    assert httpx.get(f"{server}/health", timeout=10).json()["version"] == 1
    assert greedy(server) == before


@pytest.mark.slow
def test_an_rl_run_replays_every_trained_token_and_reports_agreement_per_layer(write_toml, tmp_path):
    """The whole loop on models/tiny-moe: the engine records, the batch carries, the trainer (FSDP2)
    replays every trained token's routing, publishes, and the engine reloads (re-packed experts)."""
    import json
    import subprocess

    from conftest import free_port, rl_command
    from rl.rundir import RunDir

    run = RunDir(tmp_path / "run")
    # 4 steps: with max_async_level = 1, step n trains on samples of version n - 1 or later, so
    # steps 2 to 4 train on what engines reloaded (and re-packed) 1 to 3 times recorded.
    steps = 4
    cfg = write_toml(
        f'model = "{MOE_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = {steps}\nseq_len = 64\nmax_async_level = 1\n'
        f'[inference]\nport = {free_port()}\ndtype = "float32"\nrecord_routing = true\n'
        "[orchestrator]\nscheduling.prompts_per_step = 4\nscheduling.group_size = 4\nsampling.max_tokens = 12\n"
        "[trainer]\ntorch_threads = 1\nmismatch.routing_replay = true\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    trainer = [r for r in map(json.loads, run.metrics.read_text().splitlines()) if r.get("program") == "trainer"]
    assert [r["step"] for r in trainer] == list(range(1, steps + 1))
    for r in trainer:
        assert r["routing_replayed_frac"] == 1.0
        layers = [r[f"routing_agreement/layer_{i}"] for i in range(4)]
        assert all(0.0 <= a <= 1.0 for a in layers)
        assert r["routing_agreement"] == pytest.approx(sum(layers) / 4)
    # Step 1 trains on version 0's samples with version 0's weights: the trainer's own routing is
    # the engine's but where float32 rounding flips a near-tie. Rounding moves a router logit (a
    # 128-term product, sum |h w| ~ 10 with routers at std 0.1: make_tiny_model.py) by at most
    # 128 x 2^-24 x 10 ~ 1e-4, against logits ~1 apart: ties that close are ~1e-4 of positions. A
    # record filed under the wrong request or position would agree by chance only (1 in 6 pairs).
    assert trainer[0]["routing_agreement"] >= 0.99


@pytest.mark.parametrize("parallel", [["--inference.extra_args", '["--data-parallel-size", "2"]'],
                                      ["--inference.extra_args", '["-dp", "3"]']], ids=["long-flag", "short-flag"])
def test_recording_with_several_data_parallel_ranks_is_refused_at_start(tmp_path, parallel):
    """vLLM's data-parallel MoE layers route every rank's tokens together, and its DP client answers
    collective_rpc with rank 0's workers only (inference/preflight.py routing_into_data_parallel
    says where in vLLM's source): rows would be lost or wrong, so the server refuses to start, in
    one line, exit 2, before any engine."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "asyncrl", "inference", "--model", str(MOE_MODEL), "--output_dir",
                          str(tmp_path / "run"), "--inference.record_routing", "true", *parallel, "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "inference.record_routing" in line]
    assert len(lines) == 1 and "data-parallel ranks" in lines[0] and "rank 0's workers only" in lines[0], out.stderr
    ok = subprocess.run([sys.executable, "-m", "asyncrl", "inference", "--model", str(MOE_MODEL), "--output_dir",
                         str(tmp_path / "run"), "--inference.record_routing", "true", "--dry-run"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, (ok.stdout, ok.stderr)
