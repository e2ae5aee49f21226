"""The real trainer run as a user runs it (`rl trainer`, torchrun for several ranks) on batches a
test writes, and what its runs are compared by: the published weights, the checkpoint's AdamW
state, and `assert_same_step`, the bound two runs of one optimizer step must meet (shared by
the trainer, LoRA, expert- and context-parallel tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM

from conftest import TINY_MODEL, free_port
from rl.batch import Batch
from rl.config import OptimConfig
from rl.rundir import RunDir
from samples import single_turn, write_batch

PROMPT = [3, 4, 5, 29]  # "abc="
GOOD, BAD = [5, 4, 3, 1], [9, 9, 9, 1]  # "cba<eos>" and "ggg<eos>"
LONG = [5, 4, 3, 7, 8, 9, 10, 11, 12, 1]  # a different length, so packing and balancing matter


def completion_logprob(model, completion: list[int]) -> float:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return float(logp[torch.arange(len(targets)), targets][len(PROMPT) - 1:].sum())


def write_batches(run: RunDir, steps, *, prompts: int = 4) -> None:
    """Batches whose inference logprobs are the base model's: the first step is on-policy."""
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)

    def sample(completion, adv):
        ids = torch.tensor([PROMPT + completion])
        with torch.no_grad():
            logp = torch.log_softmax(base(input_ids=ids).logits[0, :-1], -1)
        per_token = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(PROMPT) - 1:].tolist()
        return single_turn(PROMPT, completion, per_token, [0] * len(completion), reward=0.5 + adv, advantage=adv)
    for n in steps:
        samples = [sample(GOOD, 0.5), sample(BAD, -0.5), sample(LONG, 0.25 * (-1) ** n)] * prompts
        write_batch(Batch.from_samples(n, samples[:-1]), run.rollout_dir(n))  # odd count: ranks differ


def on_policy_kl_bound(completions: list[list[int]]) -> float:
    """The most mismatch_kl (mean k3 over loss tokens) float32 rounding allows between the
    trainer's logprobs and the base model's (write_batches'), temperature 1: each token's logits
    within gap of each other (tests/trainer/test_sampling_mask.py logits_and_gap), its logprob within
    2 * gap, its k3 at most k3(2 * gap)."""
    from float32_rounding import k3, logits_and_gap

    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    bounds = []
    for completion in completions:
        _, gap = logits_and_gap(base, input_ids=torch.tensor([PROMPT + completion]))
        bounds.append(2 * gap[0, len(PROMPT) - 1:-1].double())
    return float(k3(torch.cat(bounds)).mean())


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(free_port()), "-m", "trainer"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run_trainer(cmd: list[str], cfg_args: list[str]) -> str:
    result = subprocess.run(cmd + cfg_args, capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants: torchrun starts its workers in sessions of
    their own, so killing its process group would leave them running."""
    def children(p: int) -> list[int]:
        out = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def trainer_metrics(run: RunDir) -> list[dict]:
    return [r for r in map(json.loads, run.metrics.read_text().splitlines()) if r["program"] == "trainer"]


def weights(run: RunDir, step: int) -> dict[str, torch.Tensor]:
    return load_file(run.weights_dir(step) / "model.safetensors")


def checkpoint_state(run: RunDir, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per trained parameter, from the trainer checkpoint after `step`: its weights and AdamW's
    moments exp_avg and exp_avg_sq, as full tensors whatever the world size that wrote them."""
    path = run.checkpoint_dir(step) / "trainer"
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "no process group: loading in a single process" is the intent
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    out = {}
    for key, exp_avg in state.items():
        if key.endswith(".exp_avg"):  # optim.state.<name> (whole model) or optim.<name> (LoRA)
            name = key.removeprefix("optim.").removeprefix("state.").removesuffix(".exp_avg")
            weight = state[f"model.{name}"] if f"model.{name}" in state else state[f"adapter.{name}"]
            out[name] = (weight, exp_avg, state[f"{key}_sq"])
    return out


ADAM_EPS = 1e-8  # torch.optim.AdamW's default; trainer/optim.py sets no other


def assert_same_step(a: RunDir, b: RunDir, step: int) -> None:
    """`a` and `b` took optimizer step `step` on the same batch from the same weights and AdamW
    moments, summing in different orders (ranks, micro-batches, and the CPU's kernels, which
    block a matrix product differently on AVX2 and AVX-512). Compared is what that order can
    change only by float32 rounding: reordering a sum of n terms moves it by at most ~n * 6e-8
    of their magnitude, here n <= ~400 (tokens, hidden sizes): < 3e-5. A rank's share dropped or
    counted twice moves the same quantities by ~1/2.

    - Loss and gradient norm (before clipping): relative 1e-4.
    - Each entry of the (clipped) gradient, read back from AdamW's first moment (from a common
      start, exp_avg_a - exp_avg_b = (1 - beta1) (g_a - g_b)): within 1e-4 of the largest
      entry. (Measured under every kernel choice tried: < 1.1e-6.)
    - The weights, as far as the moments pin them down. AdamW moves an entry by
      lr * m / (sqrt(v) + eps) (bias-corrected), so the runs' weights differ by at most
      lr (|m_a - m_b| + r |sqrt(v_a) - sqrt(v_b)|) / (sqrt(v_a) + eps), r = |m_b| / (sqrt(v_b) + eps)
      (<= ~1), plus float32 rounding: a tiny fraction of lr where sqrt(v) is far above the
      gradients' rounding, but up to lr either way where a gradient is within rounding of zero
      or of the order of eps. There rounding sets the update's size and even its sign, so
      comparing such an entry more tightly would compare CPUs, not ranks.
    """
    ma, mb = ([m for m in trainer_metrics(r) if m["step"] == step][-1] for r in (a, b))
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-4, abs=1e-7)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
    lr, (beta1, beta2) = ma["lr"], OptimConfig().betas
    sa, sb = checkpoint_state(a, step), checkpoint_state(b, step)
    assert sa.keys() == sb.keys()
    before = checkpoint_state(a, step - 1) if step > 1 else None
    largest = max(float((exp_avg - (beta1 * before[k][1] if before else 0)).abs().max()) / (1 - beta1)
                  for k, (_, exp_avg, _) in sa.items())
    for k, (wa, exp_avg_a, exp_avg_sq_a) in sa.items():
        wb, exp_avg_b, exp_avg_sq_b = sb[k]
        grad_diff = float((exp_avg_a - exp_avg_b).abs().max()) / (1 - beta1)
        assert grad_diff <= 1e-4 * largest, f"{k}: step {step} gradients differ by {grad_diff:.3g} ({largest=:.3g})"
        m_a, m_b = exp_avg_a / (1 - beta1 ** step), exp_avg_b / (1 - beta1 ** step)
        s_a, s_b = (exp_avg_sq_a / (1 - beta2 ** step)).sqrt(), (exp_avg_sq_b / (1 - beta2 ** step)).sqrt()
        r = m_b.abs() / (s_b + ADAM_EPS)
        allowed = lr * ((m_a - m_b).abs() + r * (s_a - s_b).abs()) / (s_a + ADAM_EPS)
        allowed += 1e-5 * (lr + wa.abs())  # float32 rounding of update and weight: a few 1e-7 of them
        bad = (wa - wb).abs() > allowed
        assert not bad.any(), (f"{k}: {int(bad.sum())} weights differ after step {step} by more than their "
                               f"moments allow, by up to {float((wa - wb).abs()[bad].max()):.3g} (lr {lr})")


def config(write_toml, run: RunDir, name: str, extra: str = "") -> str:
    return str(write_toml(f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 2\nseq_len = 32\n'
                          "[trainer]\nbatching.micro_batch_tokens = 40\ntorch_threads = 1\n"
                          "[trainer.optim]\nlr = 1e-4\n" + extra, name))
