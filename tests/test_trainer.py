"""The trainer as a real program (FSDP2, gloo): consumes batch n, publishes weights/step_n."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import TINY_MODEL, free_port, rl_command
from rl.batch import Batch, Sample
from rl.rundir import RunDir

PROMPT = [3, 4, 5, 29]  # "abc="
GOOD, BAD = [5, 4, 3, 1], [9, 9, 9, 1]  # "cba<eos>" and "ggg<eos>"


def completion_logprob(model, completion: list[int]) -> float:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return float(logp[torch.arange(len(targets)), targets][len(PROMPT) - 1:].sum())


def write_batches(run: RunDir, steps: int) -> None:
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    def sample(completion, adv):
        ids = torch.tensor([PROMPT + completion])
        with torch.no_grad():
            logp = torch.log_softmax(base(input_ids=ids).logits[0, :-1], -1)
        per_token = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(PROMPT) - 1:].tolist()
        return Sample.single_turn(PROMPT, completion, per_token, [0] * len(completion), reward=0.5 + adv, advantage=adv)
    for n in range(1, steps + 1):
        Batch.from_samples(n, 1.0, [sample(GOOD, 0.5), sample(BAD, -0.5)] * 4).write(run.rollout_dir(n))


def run_trainer(cmd: list[str], cfg_args: list[str], env=None) -> None:
    result = subprocess.run(cmd + cfg_args, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_trainer_steps_move_policy_towards_positive_advantage(tmp_path, write_toml, ranks):
    run = RunDir(tmp_path / "run")
    write_batches(run, steps=2)
    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 2\n'
                     "[trainer]\nmicro_batch_size = 2\n[trainer.optim]\nlr = 1e-4\n")
    if ranks == 1:
        run_trainer(rl_command("trainer"), ["@", str(cfg)])
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run_trainer([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-port", str(free_port()), "-m", "trainer"], ["@", str(cfg)], env)

    for n in (1, 2):
        assert (run.weights_dir(n) / "STABLE").exists()
        assert (run.weights_dir(n) / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(run.weights_dir(2), dtype=torch.float32)
    # The published checkpoint keeps the tied embedding tied.
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    # Positive advantage for GOOD, negative for BAD: the policy moves from BAD towards GOOD.
    def gap(model):
        return completion_logprob(model, GOOD) - completion_logprob(model, BAD)
    assert gap(trained) > gap(base) + 0.5
    metrics = [line for line in run.metrics.read_text().splitlines() if '"trainer"' in line]
    assert len(metrics) == 2


def test_trainer_refuses_an_earlier_runs_weights(tmp_path, write_toml):
    run = RunDir(tmp_path / "run")
    run.make()
    run.weights_dir(4).mkdir()
    cfg = write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\n')
    result = subprocess.run(rl_command("trainer", "@", str(cfg)), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "already holds weights" in result.stderr


def test_ranks_get_equal_micro_batch_counts_even_with_odd_sample_counts():
    """Sample counts vary (failed rollouts leave groups smaller): every rank must still run the
    same number of forward/backward passes, padding-only ones included, or FSDP2 hangs."""
    from trainer.data import rank_micro_batches

    for samples, world, mbs in [(5, 2, 1), (7, 4, 1), (9, 2, 2), (3, 2, 4)]:
        batch = Batch.from_samples(1, 1.0, [Sample.single_turn([5, 6], [7], [-1.0], [0], 1.0, 0.5)] * samples)
        per_rank = [rank_micro_batches(batch, r, world, mbs, pad_id=0) for r in range(world)]
        assert len({len(p) for p in per_rank}) == 1, (samples, world, mbs)
        trained = sum(int(mb.loss_mask.sum()) for p in per_rank for mb in p)
        assert trained == samples  # each sample's one completion token, once; padding adds none
