"""Context parallelism's per-share signals equal one rank's: routing replay (each rank's routers
replay the record of its share of every row; agreement counted per share and summed), the
sampling mask (kept sets rebuilt on the rank holding each position, misses summed over the group)
with per-token (teacher) advantages and a KL reference. The attention, logprobs and gradients
of the split themselves: tests/trainer/test_context_parallel.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from conftest import free_port

pytestmark = pytest.mark.slow

# --- routing replay on a tiny Qwen3-MoE, rows split over two ranks -------------------------------

MOE_LAYERS, EXPERTS, TOP_K, VOCAB, ROW = 3, 4, 2, 20, 32


def routed_batch():
    """Three samples packed into one 32-token row (documents cross the CP = 2 boundary at 16), each
    with a recorded routing that differs from the model's own choice (random experts), so replay
    changes the logprobs and gradients, and a wrong cut of the record shows."""
    from rl.batch import Batch, Sample

    rng = np.random.default_rng(1)
    samples = []
    for i, n in enumerate((11, 9, 10)):
        experts = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(n * MOE_LAYERS)]).reshape(
            n, MOE_LAYERS, TOP_K).astype(np.uint8)
        routed = np.ones(n, np.uint8)
        routed[-1] = 0  # the last sampled token: never fed forward, no record
        samples.append(Sample(tokens=rng.integers(1, VOCAB, n).tolist(), loss_mask=[0, 0] + [1] * (n - 2),
                              logprobs=[0.0, 0.0] + (-rng.random(n - 2)).tolist(),
                              advantages=[0.0, 0.0] + rng.normal(0, 1, n - 2).tolist(), versions=[-1, -1] + [0] * (n - 2),
                              reward=1.0, routed_experts=experts, routed=routed))
    meta, payload = Batch.from_samples(1, samples).encode()
    return Batch.decode(meta, payload, "test")


def routing_worker(rank: int, world: int, port: int, out: str, broken: bool) -> None:
    import torch.distributed as dist
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rl.config import LossConfig, ParallelConfig
    from trainer import context_parallel
    from trainer.data import loss_weights, rank_micro_batches
    from trainer.context_parallel import ContextShare
    from trainer.logprob_head import install
    from trainer.loss import policy_loss
    from trainer.model import micro_batch_logprobs
    from trainer.parallel import build_layout
    from trainer.routing_replay import RoutingReplay
    from trainer.trainer import routing_record

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layout = build_layout(ParallelConfig(context=world), torch.device("cpu"))
    if world > 1:
        context_parallel.register()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=MOE_LAYERS,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, moe_intermediate_size=32, norm_topk_prob=True,
                            max_position_embeddings=64, tie_word_embeddings=False,
                            attn_implementation=context_parallel.NAME if world > 1 else "sdpa")
    model = Qwen3MoeForCausalLM(config).to(torch.float64)
    model.set_experts_implementation("eager")  # grouped_mm has no float64
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.train()
    install(model, chunk_tokens=16)
    replay = RoutingReplay(model, replay=True)
    scales = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, o: scales.append(
        (args[0].detach().abs().reshape(-1, args[0].shape[-1]) @ m.weight.detach().abs().T).amax()))
    batch = routed_batch()
    (mb,) = rank_micro_batches(batch, layout.batch_rank, layout.batch_ranks, row_len=ROW, per_micro_batch=1,
                               pad_id=0, weights=loss_weights(batch, "token", ROW))
    # broken: the record not cut per share (every rank replays the first share's record)
    cut = ContextShare(layout.context.group, layout.context.size, 0) if broken else layout.context
    with replay.recorded(*routing_record(mb, cut)):
        logprobs, entropy = micro_batch_logprobs(model, mb, torch.device("cpu"), single_row=False,
                                                 context=layout.context)
        replay.end_forward()
        loss = policy_loss(logprobs, mb.inference_logprobs.double(), mb.advantages.double(), mb.loss_mask,
                           mb.loss_weight.double(), mb.sequence_ids, LossConfig()).loss
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():  # no FSDP here: the group's shares of the gradient add up to the row's
        dist.all_reduce(g)
    sums = replay.take_sums()
    dist.all_reduce(sums)
    if rank == 0:
        save_file({"logprobs": logprobs.detach().clone(), "mask": mb.loss_mask, "scale": max(scales)[None],
                   "sums": sums, **{f"grad.{n}": g.contiguous() for n, g in grads.items()}}, out)
    dist.destroy_process_group()


def routing_run(world: int, tmp_path, broken: bool = False) -> dict[str, torch.Tensor]:
    out = str(tmp_path / f"routing_cp{world}{'_broken' if broken else ''}.safetensors")
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(routing_worker, args=(world, free_port(), out, broken), nprocs=world, join=True)
    return load_file(out)


def test_routing_replay_on_split_rows_equals_one_rank(tmp_path, monkeypatch):
    """CP = 2 with routing replay: logprobs and every gradient (the routers' included) equal one
    rank's within float64 rounding's bound (tests/float32_rounding.py's float64 analysis, 3 MoE layers
    of 9 chained products each), and the agreement and replay counts summed over the group are the
    one rank's. Cutting the record at the wrong place (every rank given the first share's record)
    fails the comparison."""
    from float32_rounding import assert_equal_within_rounding

    want = routing_run(1, tmp_path)
    got = routing_run(2, tmp_path)
    assert_equal_within_rounding(got, want, chained=MOE_LAYERS * 9 + 1)
    assert torch.equal(got["sums"], want["sums"]) and float(want["sums"].sum()) > 0
    assert any(k.startswith("grad.") and "mlp.gate" in k for k in want)
    # Replay matters here: the record differs from the model's own choice (agreement below 1).
    agreeing, routed = want["sums"][:MOE_LAYERS], want["sums"][MOE_LAYERS]
    assert float(agreeing.max()) < float(routed)

    broken = routing_run(2, tmp_path, broken=True)
    with pytest.raises(AssertionError, match="differ by"):
        assert_equal_within_rounding(broken, want, chained=MOE_LAYERS * 9 + 1)


# --- the sampling mask and per-token (teacher) advantages on each rank's share --------------------


def write_truncated_batch(run, step: int) -> None:
    """Samples drawn with top_p 0.7 at temperature 0.8 (the trainer rebuilds each token's kept set
    from its own logits: on a split row, from each rank's share) with per-token advantages, as an
    on-policy teacher's signal gives them (one value per token, not per sample)."""
    import numpy as np

    from rl.batch import Batch, Sample
    from samples import write_batch
    from trainer_runs import BAD, GOOD, LONG, PROMPT

    rng = np.random.default_rng(step)
    samples = []
    for completion in (GOOD, BAD, LONG) * 3:
        p, c = len(PROMPT), len(completion)
        samples.append(Sample(PROMPT + completion, [0] * p + [1] * c, [0.0] * p + (-rng.random(c) * 2).tolist(),
                              [0.0] * p + rng.normal(0, 1, c).tolist(), [-1] * p + [0] * c, 0.5, 0.8, 0.7, -1, 0.0))
    write_batch(Batch.from_samples(step, samples[:-1]), run.rollout_dir(step))


def test_the_sampling_mask_and_per_token_advantages_on_split_rows_equal_one_rank(write_toml, tmp_path):
    """`rl trainer` on two ranks splitting every row (context 2) and on one rank take the same
    first step (tests/trainer_runs.py assert_same_step's bounds) on a batch of truncated samples
    (the sampling mask rebuilds each kept set on the rank holding the position; the misses are
    summed over the group) with per-token advantages; the mask's metrics are the one rank's."""
    from rl.rundir import RunDir
    from conftest import rl_command
    from trainer_runs import assert_same_step, config, run_trainer, torchrun, trainer_metrics

    one, two = RunDir(tmp_path / "one"), RunDir(tmp_path / "two")
    for run in (one, two):
        write_truncated_batch(run, 1)
    every = ["--checkpoints.every", "1", "--max_steps", "1", "--trainer.loss.kl_coef", "0.05",
             "--trainer.loss.kl_target", "reference"]
    run_trainer(torchrun(2), ["@", config(write_toml, two, "two.toml"), *every, "--trainer.parallel.context", "2"])
    run_trainer(rl_command("trainer"), ["@", config(write_toml, one, "one.toml"), *every])
    assert_same_step(two, one, 1)
    (a,), (b,) = trainer_metrics(two), trainer_metrics(one)
    assert b["truncated_frac"] > 0.5 and b["sampling_mask_miss_frac"] > 0  # the mask was at work
    for key in ("truncated_frac", "loss_tokens", "masked_frac", "clipped_frac"):
        assert a[key] == b[key], key
    for key in ("sampling_mask_miss_frac", "entropy", "kl", "mismatch_kl", "ratio_mean"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
