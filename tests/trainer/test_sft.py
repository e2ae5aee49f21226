"""`rl sft` with real parts: the data step on real files and tokenizers, the trainer's FSDP2 loop
in a real process, weights a transformers model loads, exact --resume after a SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, TINY_MODEL, rl_command
from float32_rounding import LOGIT_ERROR, float64_logprobs, gamma, log_softmax_error, logit_error
from rl.sft_data import SftData, batch_rows
from sft_runs import CHAT_MODEL, REVERSE, UNINTERRUPTED, config, records, sft


def test_sft_learns_and_publishes_a_model_transformers_loads(tmp_path):
    """Raw prompt/completion rows (the char-level model has no chat template): the held-out loss
    falls, and weights/step_N is an HF model directory whose tokens are the trained ones."""
    result = sft(config(tmp_path, REVERSE), "--tracking.tensorboard", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    steps = records(run, "trainer")
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(r["loss_tokens"] > 0 for r in steps)
    # Every record reached TensorBoard (through the tracker RL runs use), and the plot was drawn.
    from tracker_files import scalars

    seen = scalars(run / "tracking" / "tensorboard")
    assert [step for step, _ in seen["trainer/nll"]] == list(range(1, 21))
    assert [step for step, _ in seen["eval/heldout/loss"]] == [0, 10, 20]
    assert (run / "loss_curve.png").stat().st_size > 0
    from transformers import AutoModelForCausalLM

    # The published model is the one trained: transformers (in float64, exact) computes the
    # held-out loss the trainer recorded (in float32) after its last step, to within float32
    # rounding; the model it started from is farther off than that.
    heldout = SftData.read(run / "sft_data" / "eval.safetensors")
    nll, rounding = heldout_nll(AutoModelForCausalLM.from_pretrained(run / "weights" / "step_20").double(), heldout)
    assert abs(nll - evals[-1]["eval/loss"]) <= rounding, (nll, evals[-1], rounding)
    start, start_rounding = heldout_nll(AutoModelForCausalLM.from_pretrained(TINY_MODEL).double(), heldout)
    assert abs(start - evals[0]["eval/loss"]) <= start_rounding, (start, evals[0], start_rounding)
    assert abs(start - evals[-1]["eval/loss"]) > rounding + start_rounding, (start, evals[-1])
    # `rl run` takes it as its model: every start-up check passes (the engine itself is the
    # end-to-end tests' part).
    check = subprocess.run(rl_command("run", "@", str(ROOT / "configs" / "reverse_demo.toml"), "--model",
                                      str(run / "weights" / "step_20"), "--output_dir", str(tmp_path / "rl"),
                                      "--dry-run"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert check.returncode == 0, check.stderr[-2000:]
    # Trained on the answer and its end of sequence only: the prompt's tokens are masked.
    data = SftData.read(run / "sft_data" / "train.safetensors")
    tokens, mask = data.row(0)
    prompt_len = int(np.argmax(mask))
    assert prompt_len > 1 and mask[prompt_len:].all() and not mask[:prompt_len].any()


def heldout_nll(model, data: SftData, error: float = LOGIT_ERROR) -> tuple[float, float]:
    """(mean negative log-likelihood per trained token of every conversation in `data`, how far the
    trainer's float32 value may be from it). `model`: in float64 (exact); `error`: the float32
    logit bound for the model the trainer ran (float32_rounding.py). Each trained token's float32
    logprob is within twice its logits' bound, plus log_softmax's own rounding (every logit is
    at most its bound / error in magnitude); the trainer sums a micro-batch's logprobs in float32
    (gamma of the token count, relative) and the rest in float64."""
    import torch

    total, slack, count = 0.0, 0.0, 0
    vocab = model.config.vocab_size
    for i in range(data.num_rows):
        tokens, mask = data.row(i)
        lp, bound = float64_logprobs(model, tokens.tolist(), error)
        picked = lp[:-1].gather(-1, torch.tensor(tokens[1:], dtype=torch.long)[:, None])[:, 0]
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        per_token = [2 * b + log_softmax_error(vocab, b / error) for b in bound[:-1][keep].tolist()]
        total -= float(picked[keep].sum())
        slack += sum(per_token)
        count += int(keep.sum())
    return total / count, (slack + gamma(count) * total) / count


def test_a_lora_sft_adapter_loads_in_peft_as_trained(tmp_path):
    """trainer.lora.rank > 0: weights/step_N is a peft adapter directory; the base model with it
    (peft) computes the held-out loss the trainer recorded. Trained with label smoothing, which
    the held-out loss is not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    body = "[trainer.lora]\nrank = 8\n" + REVERSE.replace("lr = 1e-4", "lr = 3e-3").replace("eval_every = 10", "eval_every = 0")
    result = sft(config(tmp_path, body, steps=4), "--sft.label_smoothing", "0.1")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    assert all("smoothed_loss" in r and "nll" not in r for r in records(run, "trainer"))
    evals = records(run, "eval")
    assert (run / "weights" / "step_4" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL).double()
    heldout = SftData.read(run / "sft_data" / "eval.safetensors")
    # The trainer ran the base with the adapter beside it (logit_error(8)), the test in float64.
    start, start_rounding = heldout_nll(base, heldout, logit_error(8))
    assert abs(start - evals[0]["eval/loss"]) <= start_rounding, (start, evals[0], start_rounding)
    tuned = PeftModel.from_pretrained(base, run / "weights" / "step_4").double()
    nll, rounding = heldout_nll(tuned, heldout, logit_error(8))
    assert abs(nll - evals[-1]["eval/loss"]) <= rounding, (nll, evals[-1], rounding)
    # The adapter matters: it moved the loss by more than the comparisons above allow.
    assert abs(evals[-1]["eval/loss"] - evals[0]["eval/loss"]) > rounding + start_rounding, (evals, rounding)


def test_bad_rows_are_counted_one_line_per_kind_and_a_dataset_without_usable_rows_exits_2(tmp_path):
    good = {"messages": [{"role": "user", "content": "Spell cat backward"}, {"role": "assistant", "content": "tac"}]}
    rows = [good] * 5 + [{"messages": [{"role": "user", "content": "no answer"}]}] * 3 \
        + [{"messages": [{"role": "user", "content": "x " * 80}, {"role": "assistant", "content": "y"}]}] * 2 \
        + [{"text": "neither"}] * 4
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = f'[sft]\nbatch_size = 4\n[[sft.datasets]]\npath = "{data}"\n'
    result = sft(config(tmp_path, body, model=CHAT_MODEL, steps=1))
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [line for line in result.stderr.splitlines() if "row(s) skipped" in line]
    assert len(skipped) == 3, skipped  # once each, though the start-up check read the file too
    assert any("3 row(s) skipped: no assistant turn (first: row 5)" in line for line in skipped)
    assert any("2 row(s) skipped: longer than seq_len 64 (first: row 8" in line for line in skipped)
    assert any("4 unusable row(s) skipped (row 10: has neither a 'prompt'" in line for line in skipped)
    assert SftData.read(tmp_path / "run" / "sft_data" / "train.safetensors").num_rows == 5

    data.write_text("".join(json.dumps(r) + "\n" for r in rows[5:]))
    (tmp_path / "run2").mkdir()
    result = sft(config(tmp_path, body, model=CHAT_MODEL, steps=1), "--output_dir", str(tmp_path / "run2"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl sft: sft.datasets chats: none of its first rows is usable")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """One 6-step one-rank run never interrupted, for the resume and two-rank tests (the learning
    rate is constant, so its step 1 is a 1-step run's)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result = sft(config(tmp, UNINTERRUPTED, steps=6), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "run"


def test_a_run_killed_after_a_step_resumes_to_the_same_weights(tmp_path, uninterrupted):
    """Checkpoint at step 3, SIGKILL after step 4, --resume: step 6's weights equal, bit for bit,
    those of a run never interrupted (the batches are a function of seed and step)."""
    body = "[checkpoints]\nevery = 3\n" + REVERSE.replace("eval_every = 10", "eval_every = 0")
    killed = config(tmp_path / "killed", body, steps=6)
    crashed = sft(killed, env={"ASYNCRL_CRASH_AT": "trainer.after_step:4", "OMP_NUM_THREADS": "1"})
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    resumed = sft(killed, "--resume", env={"OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoints/step_3" in resumed.stderr
    a = load_file(uninterrupted / "weights" / "step_6" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "run" / "weights" / "step_6" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in records(tmp_path / "killed" / "run", "trainer")]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 4, trained twice, recorded once


def test_batches_are_a_function_of_seed_and_step_and_each_pass_sees_every_row_once():
    lengths = np.full(10, 3)
    data = SftData(np.zeros(30, dtype=np.int64), np.ones(30, dtype=np.uint8), lengths,
                   np.asarray([0] * 7 + [1] * 3), ["a", "b"], [1.0, 1.0])
    stream = batch_rows(data, 5, 40, 1)
    assert [r for n in range(1, 11) for r in batch_rows(data, 5, 4, n)] == stream
    assert batch_rows(data, 6, 40, 1) != stream
    a_rows = [r for r in stream if r < 7]
    for start in range(0, len(a_rows) - 6, 7):  # each pass over dataset a: all 7 rows, once each
        assert sorted(a_rows[start:start + 7]) == list(range(7))


def test_two_ranks_take_the_same_step_as_one(tmp_path, uninterrupted):
    """One SFT step on two ranks (rank 0 prepares the data while rank 1 waits for it in the
    rendezvous) equals the one-rank run's first step within what summing in another order allows
    (tests/trainer_runs.py assert_same_step derives the bounds)."""
    from conftest import free_port
    from rl.rundir import RunDir
    from trainer_runs import ENV, assert_same_step

    two = config(tmp_path / "two", UNINTERRUPTED, steps=1)
    two_ranks = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), "-m", "asyncrl", "sft", "@", str(two)]
    result = subprocess.run(two_ranks, capture_output=True, text=True, timeout=600, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_step(RunDir(tmp_path / "two" / "run"), RunDir(uninterrupted), 1)
