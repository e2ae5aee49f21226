"""Starting a context-parallel trainer: `rl run` on the tiny model with every row split over two
context ranks (real vLLM, torchrun over gloo, weights published and reloaded), a seq_len longer
than one rank's micro_batch_tokens, and `rl slurm`'s trainer ranks for a [trainer.parallel]
layout (the script it renders; the cluster run of a rendered job is tests/integration/test_slurm_cluster.py)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import ROOT, TINY_MODEL, free_port, rl_command
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


# --- rl run: a real run with rows split over two ranks ------------------------------------------


@pytest.mark.slow
def test_rl_run_trains_publishes_and_reloads_with_rows_split_over_two_context_ranks(write_toml, tmp_path):
    """`rl run` with trainer.parallel.context = 2 starts two trainer ranks under torchrun (gloo),
    and a seq_len (64) twice one rank's micro_batch_tokens (32): three steps train, each version is
    published and the server reloads it (batch 3 was sampled at version >= 1: max_async_level 1),
    and the sampling mask's kept sets, recorded by the engine and replayed on each rank's share of
    every row, cover every truncated loss token (replayed 1.0, no miss)."""
    run = tmp_path / "run"
    cfg = write_toml(
        f'model = "{TINY_MODEL}"\noutput_dir = "{run}"\nmax_steps = 3\nseq_len = 64\nmax_async_level = 1\n'
        f'[inference]\nport = {free_port()}\ndtype = "float32"\nmax_logprobs = 30\n'
        "[orchestrator.scheduling]\nprompts_per_step = 4\ngroup_size = 4\n"
        "[orchestrator.sampling]\nmax_tokens = 12\ntop_p = 0.8\nrecord_kept_sets = true\n"
        "[trainer]\ntorch_threads = 1\n[trainer.batching]\nmicro_batch_tokens = 32\n[trainer.parallel]\ncontext = 2\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "2 rank(s): data 1 x context 2 x expert 1" in trainer_log
    assert "attention: context" in trainer_log
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("program") == "trainer"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["truncated_frac"] > 0 and r["sampling_mask_replayed_frac"] == 1.0, r
        assert r["sampling_mask_miss_frac"] == 0.0, r
    from rl.batch import Batch
    from rl.rundir import RunDir

    rd = RunDir(run)
    for n in (1, 2, 3):
        assert (rd.weights_dir(n) / "STABLE").exists()
    # Batch 3 was sampled by a server serving a published version (max_async_level 1: >= 1).
    assert int(Batch.read(rd.rollout_dir(3)).versions.min()) >= 1
    inference_log = (run / "logs" / "inference.log").read_text()
    assert "now serving version 1" in inference_log and "now serving version 2" in inference_log


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

