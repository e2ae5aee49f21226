"""Expert parallelism (trainer.parallel.expert, trainer/expert_parallel.py) on gloo with real
processes: two ranks each holding half of every MoE layer's experts, and four ranks as data 2 x
expert 2 (each expert shard FSDP2-sharded over its two data replicas), compute the logprobs and
gradients one unsharded model computes, within float32 rounding's bound, with routing replay
deciding the dispatch; a dispatch that sends tokens to the wrong experts or the wrong expert group,
shards that hold the wrong experts, or an unscaled expert gradient fail the same comparison; and
the real trainer at EP=2 and at data 2 x expert 2 takes the step the one-rank trainer takes,
checkpoints in the same DCP layout, publishes the same HF tensors, and continues exactly from its
checkpoint."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import ROOT, free_port, rl_command
from float32_rounding import logit_error

TINY_MOE = ROOT / "models" / "tiny-moe"
# Per MoE layer on a logit's path: q/k/v, scores, values, o, the router, gate/up, down, the
# weighted sum of top_k outputs (float32_rounding.py's derivation, two more products than dense).
MOE_LOGIT_ERROR = logit_error(8)
# tests/trainer_runs.py assert_same_step: reordering a float32 sum of n <= ~400 terms moves it by
# < 3e-5 of their magnitude; a gradient entry is compared within 1e-4 of the largest entry, and a
# wrongly dispatched token moves entries by a large share of it.
GRAD_SHARE = 1e-4
FAULTS = ("none", "misrouted", "misplaced")


def qwen2_moe() -> torch.nn.Module:
    """A random Qwen2-MoE (shared expert beside 4 routed ones), built in-process."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=48,
                            max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)  # clear margins: no near-ties for rounding to flip
    return model.float()


def tiny_moe() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_MOE, dtype=torch.float32)


def logprobs_with_bound(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs of the next tokens [R, T-1], float32 rounding's bound on each: twice the logit's,
    MOE_LOGIT_ERROR x max_i sum_j |E_ij h_j| at the head's input h; the bound is meaningful for
    a float64 model's exact values)."""
    head = model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        logits = model(input_ids=tokens, use_cache=False).logits
    finally:
        hook.remove()
    lp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    weight = head.weight.full_tensor() if hasattr(head.weight, "full_tensor") else head.weight
    scale = torch.einsum("vh,rth->rtv", weight.detach().abs().double(), seen[0].detach().abs().double()).amax(-1)
    return lp, 2 * MOE_LOGIT_ERROR * scale[:, :-1]


def record(model, tokens: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing record unlike the model's own choice: two distinct random experts per position and
    layer, three positions in four recorded (the rest keep the router's choice)."""
    from trainer.routing_replay import routers

    layers, (_, router) = len(routers(model)), routers(model)[0]
    g = torch.Generator().manual_seed(100 + rank)
    rows = torch.stack([torch.randperm(router.num_experts, generator=g)[:router.top_k]
                        for _ in range(tokens.numel() * layers)])
    routed = torch.rand(tuple(tokens.shape), generator=g) < 0.75
    return rows.reshape(*tokens.shape, layers, router.top_k), routed


def compare(build, layout, fault: str, replay: bool, device: torch.device = torch.device("cpu")) -> dict:
    """Max over this rank's positions of |EP - exact| / bound (logprobs), and over every gradient
    entry of |EP - one model| / (GRAD_SHARE x the largest entry), with `fault` put into the dispatch.
    `layout`: trainer/parallel.py's mesh (the experts' dims among it). `device`: a GPU under NCCL
    (scripts/gpu_check_expert_parallel.py)."""
    from trainer import expert_parallel
    from trainer.parallel import apply_fsdp

    rank, world, ep_size = layout.rank, layout.world, layout.sizes[2]
    plain = build().to(device)
    exact, ep = copy.deepcopy(plain).double(), copy.deepcopy(plain)
    exact.set_experts_implementation("eager")  # grouped_mm has no float64
    placement, shard_rows, scale = expert_parallel.placement, expert_parallel.shard_rows, expert_parallel._GradScale
    if fault == "misrouted":  # each token to the right local index on the next rank of its expert group
        expert_parallel.placement = lambda ids, n: ((ids // n + 1) % ep_size, ids % n)
    if fault == "misplaced":  # each rank holding the next rank's experts
        expert_parallel.shard_rows = lambda shard, n: shard_rows((shard + 1) % ep_size, n)
    if fault == "unscaled":  # the experts' gradient not divided by EP (FSDP2 averages over world / EP)
        expert_parallel._GradScale = type("NoScale", (), {"apply": staticmethod(lambda x, s: x)})
    try:
        expert_parallel.apply_expert_parallel(ep, layout.experts["expert"])
        if fault == "wrong_group":  # dispatched within the data dim: ranks holding the same shard
            for experts in expert_parallel.moe_experts(ep):
                experts.expert_parallel.group = layout.group("data")
        apply_fsdp(ep, torch.float32, experts=layout.experts)
        return _compare_models(exact, plain, ep, rank, world, replay, device)
    finally:
        expert_parallel.placement, expert_parallel.shard_rows = placement, shard_rows
        expert_parallel._GradScale = scale


def _compare_models(exact, plain, ep, rank: int, world: int, replay: bool, device: torch.device) -> dict:
    from trainer import expert_parallel
    from trainer.routing_replay import RoutingReplay

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(2, plain.config.vocab_size, (2, 12), generator=g).to(device)
    coef = torch.randn(2, 11, generator=g, dtype=torch.float64).to(device)
    routing, routed = record(plain, tokens, rank)
    trained = torch.ones(tokens.shape, dtype=torch.bool)
    out = {}
    for name, model in (("exact", exact), ("plain", plain), ("ep", ep)):
        replayer = RoutingReplay(model, replay=replay)
        with replayer.recorded(routing, routed, trained):
            lp, bound = logprobs_with_bound(model, tokens)
            if name != "exact":
                ((lp * coef).sum() * (world if name == "ep" else 1)).backward()
        out[name] = lp.detach(), bound
    grads = {}
    for name, p in plain.named_parameters():
        dist.all_reduce(p.grad)  # the one model's gradient of the summed loss over every rank's tokens
        grads[name] = p.grad
    largest = max(float(g.abs().max()) for g in grads.values())
    grad_ratio = expert_ratio = 0.0
    for name, p in ep.named_parameters():
        ep_grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ratio = float((ep_grad - grads[name]).abs().max()) / (GRAD_SHARE * largest)
        grad_ratio = max(grad_ratio, ratio)
        if ".experts." in name:
            expert_ratio = max(expert_ratio, ratio)
    exact_lp, bound = out["exact"]
    return {"logprob": float(((out["ep"][0] - exact_lp).abs() / bound).max()),
            "plain_logprob": float(((out["plain"][0] - exact_lp).abs() / bound).max()),
            "grad": grad_ratio, "expert_grad": expert_ratio,
            "expert_rows": [int(p.to_local().shape[0]) for p in expert_parallel.sharded_params(ep)]}


def worker(rank: int, world: int, port: int, out: str) -> None:
    """Two ranks: expert 2 (the expert group is the world). Four: data 2 x expert 2, each expert
    shard held by two data replicas (FSDP2-sharded over them, one expert of 4 each at rest)."""
    from rl.config import ParallelConfig
    from trainer.parallel import build_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layout = build_layout(ParallelConfig(expert=2), torch.device("cpu"))
        faults = FAULTS if world == 2 else (*FAULTS, "wrong_group", "unscaled")
        results = {f"qwen3/{fault}": compare(tiny_moe, layout, fault, replay=True) for fault in faults}
        results["qwen3/own_routing"] = compare(tiny_moe, layout, "none", replay=False)
        if world == 2:
            results["qwen2"] = compare(qwen2_moe, layout, "none", replay=False)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def spawn(tmp_path_factory, world: int) -> list[dict]:
    out = tmp_path_factory.mktemp(f"ep{world}")
    mp.spawn(worker, args=(world, free_port(), str(out)), nprocs=world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return spawn(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def data_and_expert_ranks(tmp_path_factory) -> list[dict]:
    return spawn(tmp_path_factory, 4)


@pytest.mark.parametrize("case", ["qwen3/none", "qwen3/own_routing", "qwen2"])
def test_two_expert_ranks_compute_the_one_models_logprobs_and_gradients(two_ranks, case):
    """Qwen3-MoE (models/tiny-moe, with routing replay deciding the dispatch, and with its own
    routing) and Qwen2-MoE (a shared expert beside the routed ones): each rank holds 2 of 4
    experts per layer, and both ranks' logprobs are as close to the float64 model's as float32
    rounding allows, the gradients (summed over both ranks' tokens) as close to one model's."""
    for rank in two_ranks:
        r = rank[case]
        assert r["expert_rows"] and set(r["expert_rows"]) == {2}, r
        assert r["plain_logprob"] <= 1.0, r  # the bound holds for the unsharded model itself
        assert r["logprob"] <= 1.0 and r["grad"] <= 1.0, r


@pytest.mark.parametrize("fault", ["misrouted", "misplaced"])
def test_a_wrong_dispatch_fails_the_comparison(two_ranks, fault):
    """Tokens sent to the right shard index on the wrong rank, or each rank holding the other's
    experts: the comparison the test above passes fails, in logprobs and in gradients."""
    worst = {k: max(rank[f"qwen3/{fault}"][k] for rank in two_ranks) for k in ("logprob", "grad")}
    assert worst["logprob"] > 10 and worst["grad"] > 10, worst


@pytest.mark.parametrize("case", ["qwen3/none", "qwen3/own_routing"])
def test_data_2_x_expert_2_computes_the_one_models_logprobs_and_gradients(data_and_expert_ranks, case):
    """World 4 = data 2 x expert 2: each expert group (ranks 0-1, 2-3) splits every layer's 4
    experts 2 + 2, each shard FSDP2-sharded over its two data replicas (1 expert per rank at
    rest); every rank's logprobs within float32's bound of the float64 model, every gradient
    (summed over the 4 ranks' tokens: the experts' over both data replicas) as one model's."""
    for rank in data_and_expert_ranks:
        r = rank[case]
        assert r["expert_rows"] and set(r["expert_rows"]) == {1}, r
        assert r["plain_logprob"] <= 1.0, r
        assert r["logprob"] <= 1.0 and r["grad"] <= 1.0, r


@pytest.mark.parametrize("fault, fails", [("misrouted", ("logprob", "grad")), ("misplaced", ("logprob", "grad")),
                                          ("wrong_group", ("logprob", "grad")), ("unscaled", ("expert_grad",))])
def test_a_wrong_dispatch_beside_data_ranks_fails_the_comparison(data_and_expert_ranks, fault, fails):
    """Rows sent within the data dim (to the ranks holding the same shard: the wrong expert
    group), to the wrong rank of the right group, shards holding the wrong experts, or the
    experts' gradient left EP times too large: the comparison above fails."""
    worst = {k: max(rank[f"qwen3/{fault}"][k] for rank in data_and_expert_ranks) for k in fails}
    assert all(v > 10 for v in worst.values()), worst



@pytest.mark.parametrize("model, expert, world, says", [
    ("tiny-reverse", 2, "2", "trainer.parallel.expert = 2: model = {model} is not a mixture-of-experts model"),
    ("tiny-moe", 3, "3", "trainer.parallel.expert = 3 does not divide the 4 experts per MoE layer of model = {model}"),
    ("tiny-moe", 4, "2", "trainer.parallel: data x context x expert = 1 x 1 x 4 = 4, but the trainer has 2 rank(s)"),
])
def test_an_expert_split_the_model_or_the_ranks_cannot_take_is_refused_in_one_line(tmp_path, monkeypatch, model,
                                                                                    expert, world, says):
    from typer.testing import CliRunner

    from asyncrl.main import app

    path = ROOT / "models" / model
    monkeypatch.setenv("WORLD_SIZE", world)  # as torchrun sets it for each rank's own start-up checks
    result = CliRunner().invoke(app, ["trainer", "--model", str(path), "--output_dir", str(tmp_path / "out"),
                                      "--trainer.parallel.expert", str(expert), "--dry-run"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert says.format(model=path) in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world, extra", [("4", []), ("4", ["--trainer.parallel.context", "2"]),
                                          ("8", ["--trainer.parallel.context", "2"])])
def test_expert_groups_beside_data_or_context_ranks_pass_the_start_up_checks(tmp_path, monkeypatch, world, extra):
    """expert = 2 on 4 ranks (data 2 x expert 2, or context 2 x expert 2) and on 8 (data 2 x
    context 2 x expert 2): accepted at start-up (they were refused while the expert group had to be
    every rank)."""
    from typer.testing import CliRunner

    from asyncrl.main import app

    monkeypatch.setenv("WORLD_SIZE", world)
    result = CliRunner().invoke(app, ["trainer", "--model", str(TINY_MOE), "--output_dir", str(tmp_path / "out"),
                                      "--trainer.parallel.expert", "2", *extra, "--dry-run"])
    assert result.exit_code == 0, result.stderr

# --- the real trainer at EP=2 ---------------------------------------------------------------------

PROMPT = [3, 4, 5, 29]
COMPLETIONS = ([5, 4, 3, 1], [9, 9, 9, 1], [5, 4, 3, 7, 8, 9, 10, 11, 12, 1])


def write_moe_batches(run, steps) -> None:
    """Batches for models/tiny-moe with the base model's logprobs (step 1 on-policy) and a routing
    record of random expert pairs at every fed-forward position, so replay, not the router,
    decides each token's experts."""
    import numpy as np

    from rl.batch import Batch
    from samples import single_turn, write_batch

    base = tiny_moe()
    layers, top_k, experts = base.config.num_hidden_layers, base.config.num_experts_per_tok, base.config.num_experts
    rng = np.random.default_rng(0)
    for n in steps:
        samples = []
        for i, completion in enumerate(COMPLETIONS * 3):
            ids = torch.tensor([PROMPT + completion])
            with torch.no_grad():
                lp = torch.log_softmax(base(input_ids=ids).logits[0, :-1], -1)
            per_token = lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(PROMPT) - 1:].tolist()
            s = single_turn(PROMPT, completion, per_token, [0] * len(completion), reward=0.5,
                            advantage=(0.5, -0.5, 0.25)[i % 3] * (-1) ** n)
            s.routed_experts = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)])
                                         for _ in s.tokens]).astype(np.uint8)
            s.routed = np.ones(len(s.tokens), np.uint8)
            s.routed[-1] = 0  # the last token is never fed forward: no record
            samples.append(s)
        write_batch(Batch.from_samples(n, samples[:-1]), run.rollout_dir(n))  # odd count: ranks differ


def trainer_args(tmp_path: Path, run, name: str, extra: list[str] = ()) -> list[str]:
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'model = "{TINY_MOE}"\noutput_dir = "{run.root}"\nmax_steps = 2\nseq_len = 32\n'
                   "[inference]\nrecord_routing = true\n"
                   "[checkpoints]\nevery = 1\nkeep = 2\n"
                   "[trainer]\ntorch_threads = 1\nbatching.micro_batch_tokens = 40\nmismatch.routing_replay = true\n"
                   "files.keep_weights = 2\nmodel.activation_checkpointing = true\n"
                   "[trainer.optim]\nlr = 1e-3\n")
    return ["@", str(cfg), *extra]


def safetensors_layout(path: Path) -> dict:
    """name -> (dtype, shape) from a weights directory's safetensors header."""
    import struct

    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


@pytest.mark.slow
def test_the_trainer_at_data_2_x_expert_2_steps_checkpoints_publishes_and_resumes_as_one_rank(tmp_path):
    """Four ranks, data 2 x expert 2 (trainer.parallel.expert = 2, data filled in: each expert
    shard FSDP2-sharded over its two data replicas; the harder layout of the two a trainer step
    can take with EP: expert 2 alone on two ranks is this without the replicas, and its
    logprobs and gradients are checked against one rank above), routing replay on and activation
    checkpointing, against one rank: step 1 within tests/trainer_runs.py assert_same_step's derived bounds (read
    from both DCP checkpoints: the same keys, full shapes), the same published safetensors
    layout, every trained token replayed; the one-rank trainer resumed from the 2 x 2 step-1
    checkpoint takes step 2 as the 2 x 2 run did; a 2 x 2 run resumed from it publishes step 2 bit
    for bit as the uninterrupted run."""
    from rl.rundir import RunDir
    from trainer_runs import assert_same_step, run_trainer, torchrun, trainer_metrics, weights

    grid, one = RunDir(tmp_path / "grid"), RunDir(tmp_path / "one")
    for run in (grid, one):
        write_moe_batches(run, [1, 2])
    expert = ["--trainer.parallel.expert", "2"]
    log = run_trainer(torchrun(4), trainer_args(tmp_path, grid, "grid", expert))
    run_trainer(rl_command("trainer"), trainer_args(tmp_path, one, "one", ["--max_steps", "1"]))
    assert_same_step(grid, one, 1)
    assert safetensors_layout(grid.weights_dir(1)) == safetensors_layout(one.weights_dir(1))
    replayed = [m["routing_replayed_frac"] for m in trainer_metrics(grid)]
    assert replayed == [1.0, 1.0], replayed

    flat = RunDir(tmp_path / "flat")
    shutil.copytree(one.root, flat.root)
    for run in (one, flat):
        shutil.rmtree(run.checkpoint_dir(1) / "trainer")
        shutil.copytree(grid.checkpoint_dir(1) / "trainer", run.checkpoint_dir(1) / "trainer")
    run_trainer(rl_command("trainer"), trainer_args(tmp_path, flat, "flat", ["--resume"]))
    assert_same_step(grid, flat, 2)
    log = run_trainer(torchrun(4), trainer_args(tmp_path, one, "one", expert + ["--resume"]))
    assert "resumed from checkpoints/step_1: next batch is 2" in log, log[-3000:]
    a, b = weights(grid, 2), weights(one, 2)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(weights(grid, 1)["model.layers.0.mlp.experts.gate_up_proj"],
                           a["model.layers.0.mlp.experts.gate_up_proj"])  # the experts trained


def test_the_fsdp2_internals_the_expert_mesh_uses_take_what_it_passes():
    """trainer/parallel.py apply_fsdp gives the expert parameters their own FSDP2 mesh through
    shard_placement_fn returning ShardPlacementResult(placement, FSDPMeshInfo(mesh,
    shard_mesh_dim=0)): private classes of torch 2.13's FSDP2 (what torchtitan passes too). The
    data 2 x expert 2 tests above run them; this pins their shapes, to fail plainly on a torch
    that changes them."""
    import dataclasses
    import inspect

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    assert [f.name for f in dataclasses.fields(ShardPlacementResult)] == ["placement", "mesh_info"]
    assert {"mesh", "shard_mesh_dim"} <= {f.name for f in dataclasses.fields(FSDPMeshInfo)}
    assert "shard_placement_fn" in inspect.signature(fully_shard).parameters
