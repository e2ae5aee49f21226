"""Starting a context-parallel trainer: `rl run` on the tiny MoE with every row split over two
context ranks and its experts over two expert ranks (real vLLM recording the routing, torchrun over
gloo, routing replay, weights published and reloaded), a seq_len longer than one rank's
micro_batch_tokens, and `rl slurm`'s trainer ranks for a [trainer.parallel]
layout (the script it renders; the cluster run of a rendered job is tests/integration/test_slurm_cluster.py)."""

from __future__ import annotations

import json
import math
import re
import subprocess

import pytest

from conftest import ROOT, TINY_MODEL, free_port, rl_command
from float32_rounding import k3_error, logit_error
from rl.config import RunConfig

# --- micro-batches hold what one rank holds -----------------------------------------------------


def run_config(parallel: dict | None = None, **batching) -> RunConfig:
    return RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 512,
                                     "trainer": {"batching": batching, "parallel": parallel or {}}})


def test_seq_len_may_exceed_one_ranks_micro_batch_when_rows_are_split():
    """micro_batch_tokens is what one rank holds: at context = 2 a 512-token row is 256 per rank."""
    cfg = run_config(micro_batch_tokens=256, parallel={"context": 2})
    assert cfg.trainer.batching.micro_batch_tokens == 256
    with pytest.raises(ValueError, match=r"trainer.batching.micro_batch_tokens \(256\) must be >= seq_len \(512\)"):
        run_config(micro_batch_tokens=256)
    with pytest.raises(ValueError, match=r"trainer.batching.micro_batch_tokens \(128\) x trainer.parallel.context \(2\) "
                                         r"must be >= seq_len \(512\)"):
        run_config(micro_batch_tokens=128, parallel={"context": 2})


def test_a_context_group_packs_context_times_the_rows_of_one_rank():
    from trainer.trainer import rows_per_micro_batch

    t = run_config(micro_batch_tokens=1024, parallel={"context": 4}).trainer.batching
    assert rows_per_micro_batch(t, 512, 1) == 2
    assert rows_per_micro_batch(t, 512, 4) == 8  # each rank: 8 rows x 128 of their tokens = 1024
    assert rows_per_micro_batch(run_config(micro_batch_tokens=256, parallel={"context": 2}).trainer.batching, 512, 2) == 1
    assert rows_per_micro_batch(run_config(pack=False, micro_batch_size=3).trainer.batching, 512, 4) == 3


def test_the_shared_gpu_model_counts_one_ranks_share_of_a_split_row():
    from rl.gpu_placement import micro_batch_tokens

    assert micro_batch_tokens(run_config(micro_batch_tokens=1024)) == 1024
    assert micro_batch_tokens(run_config(micro_batch_tokens=256, parallel={"context": 2})) == 256
    assert micro_batch_tokens(run_config(micro_batch_tokens=1024, parallel={"context": 4})) == 1024
    assert micro_batch_tokens(run_config(pack=False, micro_batch_size=2, parallel={"context": 2})) == 512


# --- rl slurm: the ranks a layout needs -----------------------------------------------------------


def slurm(write_toml, tmp_path, gpus: int, nodes: int, parallel: str) -> subprocess.CompletedProcess:
    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\n'
                     f"[slurm]\ntrainer_nodes = {nodes}\ngpus_per_node = {gpus}\n"
                     f"[trainer.parallel]\n{parallel}\n")
    return subprocess.run(rl_command("slurm", "@", str(cfg)), capture_output=True, text=True, timeout=120)


def torchrun_line(script: str) -> str:
    (line,) = re.findall(r"python -m torch\.distributed\.run [^\n]*", script)
    return line


@pytest.mark.parametrize("nodes, parallel, want", [
    (1, "context = 2", "--nnodes 1 --nproc-per-node 2"),
    (2, "context = 2", "--nnodes 2 --nproc-per-node 2"),  # data = 0: one context group per node
    (2, "data = 2\ncontext = 2\nexpert = 1", "--nnodes 2 --nproc-per-node 2"),
    (1, "", "--nnodes 1 --nproc-per-node 1"),
])
def test_a_cpu_cluster_job_starts_the_ranks_the_layout_needs(write_toml, tmp_path, nodes, parallel, want):
    out = slurm(write_toml, tmp_path, 0, nodes, parallel)
    assert out.returncode == 0, out.stderr
    assert want in torchrun_line(out.stdout)
    assert "span nodes" not in out.stderr


@pytest.mark.parametrize("gpus, nodes, parallel, message", [
    (4, 2, "data = 3\ncontext = 2", "data x context x expert = 3 x 2 x 1 = 6, but the trainer has 8 rank(s)"),
    (2, 1, "data = 2\ncontext = 2", "(slurm.trainer_nodes 1 x 2 rank(s) per node; slurm.trainer_nodes = 2 would)"),
    (4, 1, "context = 3", "= 1 x 3 x 1 = 3, but the trainer has 4 rank(s)"),
    (0, 2, "data = 3\ncontext = 1", "3 rank(s) do not split evenly over slurm.trainer_nodes (2)"),
])
def test_a_layout_the_jobs_ranks_cannot_hold_is_refused_in_one_line(write_toml, tmp_path, gpus, nodes, parallel,
                                                                    message):
    out = slurm(write_toml, tmp_path, gpus, nodes, parallel)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert out.stderr.startswith("rl slurm: trainer.parallel")


def test_a_gpu_job_fills_data_from_its_ranks_and_says_when_a_group_spans_nodes(write_toml, tmp_path):
    out = slurm(write_toml, tmp_path, 4, 2, "context = 4")
    assert out.returncode == 0, out.stderr
    assert "--nnodes 2 --nproc-per-node 4" in torchrun_line(out.stdout) and "span nodes" not in out.stderr
    out = slurm(write_toml, tmp_path, 2, 2, "context = 4")
    assert out.returncode == 0, out.stderr
    assert "context x expert groups of 4 ranks span nodes (2 rank(s) per node)" in out.stderr


# --- rl run: a real run with rows split over two context ranks and experts over two ranks ------

TINY_MOE = ROOT / "models" / "tiny-moe"
# models/tiny-moe's logit paths, per layer (tests/float32_rounding.py's count): the engine's q/k/v,
# scores, values, o, router, experts' gate/up, down, their weighted sum (as
# tests/inference/test_routing_vllm.py); the trainer's the same and the context attention's merge
# of a share's two blocks (docs/trainer.md "Context parallelism").
ENGINE_LOGIT_ERROR, TRAINER_LOGIT_ERROR = logit_error(9), logit_error(10)


def replayed_head_scale(batch) -> float:
    """max_i sum_j |E_ij h_j| over the batch's trained positions, h the lm_head's input in a
    float64 forward of models/tiny-moe with the engine's recorded routing replayed: the scale
    float32 rounding's bound on a logit is relative to (tests/float32_rounding.py)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.routing_replay import RoutingReplay

    model = AutoModelForCausalLM.from_pretrained(TINY_MOE, dtype=torch.float64, experts_implementation="eager").eval()
    head = model.get_output_embeddings()
    layers, top_k = (int(x) for x in batch.routing_shape)
    experts = torch.from_numpy(batch.routed_experts.astype(np.int64)).reshape(-1, layers, top_k)
    scale, start = 0.0, 0
    for n in batch.lengths.tolist():
        at = slice(start, start + n)
        trained = torch.zeros(1, n, dtype=torch.bool)
        trained[0, :-1] = torch.from_numpy(batch.loss_mask[at][1:] > 0)  # position t predicts t + 1
        routed = torch.from_numpy(batch.routed[at] > 0)[None]
        replay, seen = RoutingReplay(model, replay=True), []
        hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0][0]))
        try:
            with replay.recorded(experts[at][None], routed, trained), torch.no_grad():
                model(input_ids=torch.from_numpy(batch.tokens[at])[None])
        finally:
            hook.remove()
            replay.remove()
        scale = max(scale, float((head.weight.detach().abs() @ seen[0].abs().T).max(0).values[trained[0]].max()))
        start += n
    return scale


@pytest.mark.slow
def test_rl_run_trains_a_moe_with_rows_over_two_context_ranks_and_experts_over_two(write_toml, tmp_path):
    """`rl run` with trainer.parallel context 2 x expert 2 (data 1) on models/tiny-moe starts four
    trainer ranks under torchrun (gloo), real vLLM recording each position's experts, routing
    replay on, and a seq_len (64) twice one rank's micro_batch_tokens (32): three steps train, each
    version is published and the server reloads it (batch 3 was sampled at version >= 1:
    max_async_level 1); every trained token is replayed over the engine's experts, and the sampling
    mask's kept sets over every truncated loss token (replayed 1.0, no miss), each on each rank's
    share of every row. Step 1 trains at the version that sampled its batch, so the trainer's
    logprobs are the engine's within float32 rounding: its mismatch_kl stays within that bound
    (replaying the first share's record on both context ranks gave 3.6e-3; the bound is ~1e-4)."""
    run = tmp_path / "run"
    cfg = write_toml(
        f'model = "{TINY_MOE}"\noutput_dir = "{run}"\nmax_steps = 3\nseq_len = 64\nmax_async_level = 1\n'
        f'[inference]\nport = {free_port()}\ndtype = "float32"\nmax_logprobs = 30\nrecord_routing = true\n'
        "[orchestrator.scheduling]\nprompts_per_step = 4\ngroup_size = 4\n"
        "[orchestrator.sampling]\nmax_tokens = 12\ntop_p = 0.8\nrecord_kept_sets = true\n"
        "[trainer]\ntorch_threads = 1\n[trainer.batching]\nmicro_batch_tokens = 32\n"
        "[trainer.files]\nkeep_rollouts = 3\n[trainer.parallel]\ncontext = 2\nexpert = 2\n[trainer.mismatch]\nrouting_replay = true\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "4 rank(s): data 1 x context 2 x expert 2" in trainer_log
    assert "attention: context" in trainer_log
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("program") == "trainer"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["truncated_frac"] > 0 and r["sampling_mask_replayed_frac"] == 1.0, r
        assert r["sampling_mask_miss_frac"] == 0.0, r
        assert r["routing_replayed_frac"] == 1.0 and 0 < r["routing_agreement"] <= 1, r
        assert all(f"routing_agreement/layer_{layer}" in r for layer in range(4)), r
    from rl.batch import Batch
    from rl.rundir import RunDir

    rd = RunDir(run)
    for n in (1, 2, 3):
        assert (rd.weights_dir(n) / "STABLE").exists()
    # Batch 3 was sampled by a server serving a published version (max_async_level 1: >= 1).
    assert int(Batch.read(rd.rollout_dir(3)).versions.min()) >= 1
    inference_log = (run / "logs" / "inference.log").read_text()
    assert "now serving version 1" in inference_log and "now serving version 2" in inference_log
    # Step 1: both logprobs within (engine + trainer error) x scale x 2 (a logprob moves twice a
    # logit's error) of the exact ones, so each token's k3 within k3 at that distance.
    first = Batch.read(rd.rollout_dir(1))
    assert steps[0]["max_staleness"] == 0 and int(first.versions.max()) == 0
    distance = 2 * (ENGINE_LOGIT_ERROR + TRAINER_LOGIT_ERROR) * replayed_head_scale(first)
    bound = math.exp(distance) - distance - 1 + k3_error(distance)
    assert abs(steps[0]["mismatch_kl"]) <= bound, (steps[0]["mismatch_kl"], bound)


# --- metrics reduced over the right ranks ---------------------------------------------------------


def test_mfu_divides_the_batchs_flops_by_every_ranks_peak(tmp_path, monkeypatch):
    """Every rank's record holds the whole batch's tokens (all data and context ranks' work), so
    its MFU is over the world's peak: 4 ranks at the same step time report a quarter of one
    rank's (found in the audit of the trainer's reductions: each rank reported world x MFU)."""
    import torch

    from trainer import metrics as m

    monkeypatch.setattr(m, "peak_flops", lambda device, dtype: 1e6)
    cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "output_dir": str(tmp_path / "run")})
    record = {"step": 1, "loss": 0.0, "grad_norm": 1.0, "entropy": 1.0, "mismatch_kl": 0.0,
              "trainer_tokens_per_s": 600.0, "tokens": 300, "step_s": 0.5, "write_s": 0.1, "wait_s": 0.0}
    got = {}
    for world in (1, 4):
        metrics = m.TrainerMetrics(cfg, 0, torch.device("cpu"), world)
        metrics.step(record, torch.nn.Linear(4, 4), "bfloat16")  # 20 parameters
        got[world] = metrics.registry.get_sample_value("asyncrl_trainer_mfu_ratio")
    assert got[1] == pytest.approx(6 * 20 * 300 / 0.5 / 1e6)
    assert got[4] == pytest.approx(got[1] / 4)

