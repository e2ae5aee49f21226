"""Context parallelism (trainer/context_parallel.py) on real gloo processes: a packed micro-batch's
logprobs and gradients at CP = 2 and 4 equal CP = 1's within rounding's derived bound, with
packing, LoRA and activation checkpointing; breaking the split's boundary handling fails that;
the mesh's start-up check; `rl sft` at CP = 2.

The comparison runs in float64 (the trainer's own functions: the model sharded by FSDP2 over the
world, trainer/model.py micro_batch_logprobs, trainer/loss.py policy_loss): the split changes
the order attention sums in, so the results differ by rounding, and float64's bound (the
analysis of tests/float32_rounding.py with u = 2^-53) is nine orders of magnitude below what a
wrong split moves (a share's queries missing the keys before it: ~1e-2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from conftest import ROOT, TINY_MODEL, free_port, rl_command
from float32_rounding import CHAINED, LAYERS, WIDEST, assert_equal_within_rounding, gamma64
from rl.batch import Batch
from samples import single_turn

pytestmark = pytest.mark.slow

# models/tiny-moe: per layer q/k/v, scores, values, o, the router, gate/up, down, the weighted sum
# of top_k outputs (tests/trainer/test_expert_parallel.py MOE_LOGIT_ERROR's count), then the lm_head.
MOE_CHAINED = LAYERS * 10 + 1
TINY_MOE = ROOT / "models" / "tiny-moe"


def packed_batch() -> Batch:
    """Samples of several lengths, packed by the trainer into one row of at most 96 tokens:
    documents start and end inside every share at CP = 2 and 4, and one spans shares."""
    rng = np.random.default_rng(0)
    samples = []
    for i, (p, c) in enumerate([(9, 31), (5, 12), (7, 19), (4, 9)]):
        prompt, completion = rng.integers(3, 30, p).tolist(), rng.integers(3, 30, c).tolist()
        samples.append(single_turn(prompt, completion, (-rng.random(c) * 3).tolist(), [0] * c, reward=0.0,
                                   advantage=(-1.0) ** i * (0.5 + 0.25 * i)))
    return Batch.from_samples(1, samples)


# Every case of a world size runs in one spawn of that many ranks: a rank's start (torch,
# transformers, our trainer imported afresh: ~6 CPU s) was most of this file's time when each
# case spawned its own (29 rank starts, ~180 CPU s; now 7). Each case: (context, opts).
CASES = {
    1: [(1, {}), (1, {"checkpointing": True, "lora": True}), (1, {"moe": True})],
    2: [(2, {}), (2, {"checkpointing": True, "lora": True}), (2, {"moe": True}),
        (2, {"broken": "keys_before"}), (2, {"broken": "local_positions"})],
    4: [(4, {}), (2, {}), (2, {"moe": True, "expert": 2}), (2, {"moe": True, "expert": 2, "broken": "expert_group"})],
}


def case_name(world: int, context: int, opts: dict) -> str:
    return f"w{world}_cp{context}_" + "_".join(f"{k}{v}" for k, v in sorted(opts.items()))


def worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank of every case of its world size, in order (every rank runs the same sequence:
    each case builds its meshes anew on the one process group)."""
    import torch.distributed as dist

    from trainer import context_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parts = context_parallel._parts
    for context, opts in CASES[world]:
        try:
            one_case(rank, world, context, opts, f"{out}/{case_name(world, context, opts)}.safetensors")
        finally:
            context_parallel._parts = parts  # a broken case's split stays with it
    dist.destroy_process_group()


def one_case(rank: int, world: int, context: int, opts: dict, out: str) -> None:
    """The micro-batch's logprobs and the gradients of its loss, saved by rank 0.
    opts["moe"]: models/tiny-moe (its own routing) instead of the dense model; opts["expert"]:
    its experts split over that many ranks (trainer/expert_parallel.py)."""
    from rl.config import LoRAConfig, LossConfig, ParallelConfig
    from trainer import context_parallel
    from trainer.data import loss_weights, rank_micro_batches
    from trainer.logprob_head import install
    from trainer.lora import LoRA
    from trainer.loss import policy_loss
    from trainer.model import micro_batch_logprobs
    from trainer.parallel import apply_fsdp, build_layout

    layout = build_layout(ParallelConfig(context=context, expert=opts.get("expert", 1)), torch.device("cpu"))
    if opts.get("broken") == "keys_before":  # a share's queries miss the keys of earlier shares
        context_parallel._parts = lambda q0, q1, s, start: [(start + q0, start + q1, True)]
    from transformers import AutoModelForCausalLM

    if context > 1:
        context_parallel.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MOE if opts.get("moe") else TINY_MODEL, dtype=torch.float64,
                                                 attn_implementation=context_parallel.NAME if context > 1 else "sdpa")
    model.train()
    if opts.get("moe"):
        from trainer.expert_parallel import apply_expert_parallel

        model.set_experts_implementation("eager")  # grouped_mm has no float64
        if layout.experts is not None:
            apply_expert_parallel(model, layout.experts["expert"])
    if opts.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = None
    if opts.get("lora"):
        lora = LoRA(model, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj"]), 1)
        lora.reset(0, seed=0)
        with torch.no_grad():  # B starts at zero: make the adapter's A gradients non-zero too
            for p in lora.params(0).values():
                p.normal_(0, 0.05)
        model.to(torch.float64)
    if opts.get("broken") == "local_positions":  # rotary positions restarting at each share
        def restart(module, args, kwargs):
            if kwargs.get("position_ids") is not None:  # (the head's probe passes none)
                kwargs["position_ids"] = kwargs["position_ids"] - kwargs["position_ids"][:, :1]
            return args, kwargs
        model.register_forward_pre_hook(restart, with_kwargs=True)
    if opts.get("broken") == "expert_group":  # tokens dispatched within the context pair, which holds the same experts
        from trainer.expert_parallel import moe_experts

        for experts in moe_experts(model):
            experts.expert_parallel.group = layout.group("context")
    install(model, chunk_tokens=16)
    apply_fsdp(model, torch.float64, reduce_dtype=torch.float64, experts=layout.experts)
    # The logits' scale for the rounding bound: max over positions and tokens of sum_j |E_vj h_j|.
    scales = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: scales.append(
        (args[0].detach().abs().reshape(-1, args[0].shape[-1]) @ m.weight.detach().abs().T).amax()))
    batch = packed_batch()
    weights = loss_weights(batch, "token", 96)
    (mb,) = rank_micro_batches(batch, layout.batch_rank, layout.batch_ranks, row_len=96, per_micro_batch=1,
                               pad_id=0, weights=weights)
    active = lora.use(0) if lora else torch.enable_grad()
    with active:
        logprobs, entropy = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=False,
                                                 context=layout.context)
        loss = policy_loss(logprobs, mb.inference_logprobs.double(), mb.advantages.double(), mb.loss_mask,
                           mb.loss_weight.double(), mb.sequence_ids, LossConfig(ratio_level="sequence")).loss
        (loss * layout.world).backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        save_file({"logprobs": logprobs.detach().clone(), "entropy": entropy.detach().clone(),
                   "loss": loss.detach()[None], "scale": max(scales)[None],
                   "mask": mb.loss_mask, **{f"grad.{n}": g.contiguous() for n, g in grads.items()}}, out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(world, context, **opts): that case's results; the first case asked of a world size
    spawns its ranks once for all of that world's CASES."""
    out = tmp_path_factory.mktemp("cases")
    spawned: set[int] = set()

    def result(world: int, context: int, **opts) -> dict[str, torch.Tensor]:
        assert (context, opts) in CASES[world], (world, context, opts)
        if world not in spawned:
            os.environ["OMP_NUM_THREADS"] = "1"
            mp.spawn(worker, args=(world, free_port(), str(out)), nprocs=world, join=True)
            spawned.add(world)
        return load_file(out / f"{case_name(world, context, opts)}.safetensors")

    return result


@pytest.fixture(scope="module")
def reference(run):
    return {opts: run(1, 1, **dict(opts)) for opts in [(), (("checkpointing", True), ("lora", True))]}


@pytest.mark.parametrize("context", [2, 4])
def test_context_parallel_equals_one_rank(context, reference, run):
    got = run(context, context)
    assert_equal_within_rounding(got, reference[()])
    # The comparison is sharp: some gradient entries are far from zero.
    assert max(float(v.abs().max()) for k, v in got.items() if k.startswith("grad.")) > 1e-3


def test_context_parallel_with_lora_and_checkpointing(reference, run):
    got = run(2, 2, checkpointing=True, lora=True)
    want = reference[(("checkpointing", True), ("lora", True))]
    assert any(k.startswith("grad.") and ".lora." in k for k in want)
    assert_equal_within_rounding(got, want)


def test_data_and_context_ranks_together(reference, run):
    """World 4 = data 2 x context 2: each context pair trains its share of the batch."""
    got = run(4, 2)
    want = reference[()]
    # The data ranks' samples differ, so only the summed gradient compares: rank 0's logprobs are
    # its own samples'.
    for k in (k for k in want if k.startswith("grad.")):
        bound = 2 * gamma64(2 * CHAINED * WIDEST + 96) * 96 * float(want[k].abs().max())
        assert float((got[k] - want[k]).abs().max()) <= bound, k


@pytest.fixture(scope="module")
def moe_reference(run):
    return run(1, 1, moe=True)


def test_a_moe_model_under_context_parallelism_equals_one_rank(moe_reference, run):
    """models/tiny-moe with every row split over 2 context ranks: each rank's routers and experts
    see its share of the tokens (routing is per token), and the logprobs and every gradient equal
    one rank's within the float64 bound (MoE's products counted)."""
    got = run(2, 2, moe=True)
    assert any(".experts." in k for k in got)
    assert_equal_within_rounding(got, moe_reference, chained=MOE_CHAINED)


def test_context_2_x_expert_2_equals_one_rank(moe_reference, run):
    """World 4 = context 2 x expert 2 (data 1): the two expert ranks train different samples,
    each row split over a context pair; experts split 2 + 2 across each expert group and
    FSDP2-sharded over the context pair (their "expert_data" dim). The summed gradients (experts
    included) equal one rank's on the whole batch, within the float64 bound; a dispatch within
    the wrong group (the context pair, which holds the same experts) fails it."""
    got = run(4, 2, moe=True, expert=2)
    assert_same_gradients(got, moe_reference, MOE_CHAINED)
    wrong = run(4, 2, moe=True, expert=2, broken="expert_group")
    with pytest.raises(AssertionError, match="differ by"):
        assert_same_gradients(wrong, moe_reference, MOE_CHAINED)


def assert_same_gradients(got: dict, want: dict, chained: int) -> None:
    """The summed gradients of a layout whose ranks train different samples (so rank 0's logprobs
    are its own samples'): assert_equal_within_rounding's gradient bound over the row's 96 tokens."""
    keys = [k for k in want if k.startswith("grad.")]
    assert keys and set(keys) == {k for k in got if k.startswith("grad.")}
    for k in keys:
        bound = 2 * gamma64(2 * chained * WIDEST + 96) * 96 * float(want[k].abs().max())
        diff = float((got[k] - want[k]).abs().max())
        assert diff <= bound, f"{k}: gradients differ by {diff:.3e} > {bound:.3e}"


@pytest.mark.parametrize("broken", ["keys_before", "local_positions"])
def test_a_wrong_split_is_caught(broken, reference, run):
    got = run(2, 2, broken=broken)
    with pytest.raises(AssertionError, match="differ by"):
        assert_equal_within_rounding(got, reference[()])


def test_layout_that_does_not_fill_the_world_is_refused(tmp_path):
    """`rl trainer` under torchrun with 3 ranks for context = 2: one line naming the key, exit 2,
    before any model is loaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           "-m", "trainer", "--model", TINY_MODEL, "--output-dir", str(tmp_path / "run"),
           "--trainer.parallel.context", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0
    assert "trainer.parallel: data x context x expert = 1 x 2 x 1 = 2, but the trainer has 3 rank(s)" in result.stderr
    assert "exitcode  : 2" in result.stderr or "exit code 2" in result.stderr.lower() or result.returncode == 1


def test_sft_with_context_parallelism(tmp_path):
    """`rl sft` on two ranks splitting every row (trainer.parallel.context = 2) takes the same first
    step as one rank (tests/trainer_runs.py assert_same_step's bounds), its metrics counted once."""
    from rl.rundir import RunDir
    from sft_runs import UNINTERRUPTED, config
    from trainer_runs import ENV, assert_same_step

    one, two = config(tmp_path / "one", UNINTERRUPTED, steps=1), config(tmp_path / "two", UNINTERRUPTED, steps=1)
    result = subprocess.run(rl_command("sft", "@", str(one)), capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    split = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
             "-m", "asyncrl", "sft", "@", str(two), "--trainer.parallel.context", "2"]
    result = subprocess.run(split, capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    a, b = RunDir(tmp_path / "two" / "run"), RunDir(tmp_path / "one" / "run")
    assert_same_step(a, b, 1)
    metrics = [json.loads(line) for line in a.metrics.read_text().splitlines()]
    want = [json.loads(line) for line in b.metrics.read_text().splitlines()]
    (got,), (ref,) = ([m for m in ms if m["program"] == "trainer"] for ms in (metrics, want))
    # Summed over ranks once per context group, not once per rank:
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4) and got["nll"] == pytest.approx(ref["nll"], rel=1e-4)


def test_the_fused_kernels_context_parallelism_calls_take_what_it_passes():
    """trainer/context_parallel.py calls torch's fused attention ops directly (their log-sum-exp is
    what the exact merge needs): the CPU pair runs in the tests above; the CUDA pair, which no
    machine here runs, is pinned by its schema (positional arguments in this order)."""
    names = {op: [a.name for a in getattr(torch.ops.aten, op).default._schema.arguments] for op in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")}
    assert names["_scaled_dot_product_flash_attention"] == [
        "query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"]
    assert names["_scaled_dot_product_flash_attention_backward"] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
        "dropout_p", "is_causal", "philox_seed", "philox_offset", "scale"]
    assert names["_scaled_dot_product_flash_attention_for_cpu"] == [
        "query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
    assert names["_scaled_dot_product_flash_attention_for_cpu_backward"] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask", "scale"]


def test_launcher_starts_the_configured_ranks_and_refuses_a_layout_its_gpus_cannot_hold():
    from asyncrl.launcher import command, trainer_ranks
    from rl.config import ConfigError, ParallelConfig, RunConfig
    from rl.config.parallel_layout import mesh_sizes

    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "trainer": {"parallel": {"context": 2, "expert": 2}}})
    assert trainer_ranks(cfg, None) == 4
    cmd, _ = command("trainer", ["@", "x.toml"], None, 4)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[5:7] == ["-m", "trainer"]
    assert command("trainer", [], None, 1)[0][1:4] == ["-m", "asyncrl", "trainer"]
    assert mesh_sizes(ParallelConfig(context=2), 8) == (4, 2, 1)
    assert mesh_sizes(ParallelConfig(data=2, context=2, expert=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"^trainer.parallel: data x context x expert = 1 x 4 x 1 = 4, "
                                          r"but the trainer has 6 rank"):
        mesh_sizes(ParallelConfig(context=4), 6)
    with pytest.raises(ConfigError, match="= 3 x 2 x 1 = 6, but the trainer has 4"):
        mesh_sizes(ParallelConfig(data=3, context=2), 4)


def test_rl_trainer_step_with_rows_split_equals_one_rank(write_toml, tmp_path):
    """The RL trainer (`python -m trainer` under torchrun): world 4 = data 2 x context 2, every
    packed row split, with sequence-level ratios (GSPO: a sample's mean over both shares), takes
    the same first step as one rank (tests/trainer_runs.py assert_same_step's bounds), its metrics
    (loss, tokens, entropy) counted once per context group."""
    from rl.rundir import RunDir
    from conftest import rl_command
    from trainer_runs import assert_same_step, config, run_trainer, torchrun, trainer_metrics, write_batches

    one, four = RunDir(tmp_path / "one"), RunDir(tmp_path / "four")
    extra = "[trainer.loss]\nratio_level = \"sequence\"\n"
    for run in (one, four):
        write_batches(run, [1])
    every = ["--checkpoints.every", "1", "--max_steps", "1"]
    run_trainer(torchrun(4), ["@", config(write_toml, four, "four.toml", extra), *every,
                              "--trainer.parallel.context", "2"])
    run_trainer(rl_command("trainer"), ["@", config(write_toml, one, "one.toml", extra), *every])
    assert_same_step(four, one, 1)
    (a,), (b,) = trainer_metrics(four), trainer_metrics(one)
    assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-4)
    assert a["loss_tokens"] == b["loss_tokens"]
