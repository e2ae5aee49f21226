"""The trainer as a real program (FSDP2, gloo): consumes batch n, publishes weights/step_n."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import TINY_MODEL, rl_command
from rl.batch import Batch
from rl.config import OptimConfig
from rl.rundir import RunDir
from samples import single_turn, write_batch
from trainer_runs import (BAD, ENV, GOOD, LONG, PROMPT, assert_same_step, checkpoint_state, completion_logprob, config,
                          kill_tree, on_policy_kl_bound, run_trainer, torchrun, trainer_metrics, weights, write_batches)

pytestmark = pytest.mark.slow

# The trainer settings of the two tests below, which share one uninterrupted two-rank run (a
# two-rank start is the costliest part of either; each had its own before): activation
# checkpointing (it may not change the maths, and the killed run must use it too for its
# weights to equal the uninterrupted run's bit for bit), lr 1e-3 with warm-up and cosine decay
# (the resumed run must bring the schedule back), and for the killed run a checkpoint at step 3
# and keep_rollouts = 1.
STEPS = 6
SHARED = ("[checkpoints]\nevery = 3\n[trainer]\nfiles.keep_rollouts = 1\ntimeouts.batch_s = 120\n"
          "model.activation_checkpointing = true\n"
          "[trainer.optim]\nlr = 1e-3\nschedule = \"cosine\"\nwarmup_steps = 2\nmin_lr_ratio = 0.2\n")
# Every step checkpointed and every checkpoint and version kept: the one-rank comparison reads
# steps 1 and 2 of it, the killed run's versions 5 and 6.
KEEP_ALL = ["--checkpoints.every", "1", "--checkpoints.keep", str(STEPS),
            "--trainer.files.keep_weights", str(STEPS)]


def shared_args(directory: Path, run: RunDir, name: str) -> list[str]:
    base, extra = directory / f"{name}.toml", directory / f"{name}.extra.toml"
    base.write_text(f'model = "{TINY_MODEL}"\noutput_dir = "{run.root}"\nmax_steps = {STEPS}\nseq_len = 32\n'
                    "[trainer]\nbatching.micro_batch_tokens = 40\ntorch_threads = 1\n")
    extra.write_text(SHARED)
    return ["@", str(base), "@", str(extra)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> RunDir:
    """Six steps on two ranks from the base model, never interrupted."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    whole = RunDir(tmp / "whole")
    write_batches(whole, range(1, STEPS + 1))
    run_trainer(torchrun(2), shared_args(tmp, whole, "whole") + KEEP_ALL)
    return whole


def test_two_ranks_match_one_rank_and_move_policy_towards_positive_advantage(tmp_path, uninterrupted):
    """Two ranks (with activation checkpointing: neither may change the maths) against one: on
    one rank, step 1 from the same start, then steps 2 on from the two-rank run's step-1
    checkpoint (DCP reshards it), each step compared where both took it from the same state
    (assert_same_step). Two independent runs would compare step 2 from weights that Adam's
    first step already set apart by rounding (an entry with a gradient near zero moves by up to
    lr either way)."""
    two, one = uninterrupted, RunDir(tmp_path / "one")
    write_batches(one, range(1, STEPS + 1))
    args = shared_args(tmp_path, one, "one") + KEEP_ALL
    run_trainer(rl_command("trainer"), args + ["--max_steps", "1"])  # step 1's lr is warm-up's, whatever max_steps
    assert_same_step(two, one, 1)
    shutil.rmtree(one.checkpoint_dir(1) / "trainer")
    shutil.copytree(two.checkpoint_dir(1) / "trainer", one.checkpoint_dir(1) / "trainer")
    log = run_trainer(rl_command("trainer"), args + ["--resume"])
    assert "resumed from checkpoints/step_1: next batch is 2" in log, log[-3000:]
    assert_same_step(two, one, 2)

    for n in range(1, STEPS + 1):
        assert (two.weights_dir(n) / "STABLE").exists() and (two.weights_dir(n) / "config.json").exists()
    m1, m2 = trainer_metrics(one), trainer_metrics(two)
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == list(range(1, STEPS + 1))
    # Step 1 is on-policy: trainer and "engine" agree to float32 rounding (write_batches' batch).
    assert m1[0]["mismatch_kl"] <= on_policy_kl_bound(([GOOD, BAD, LONG] * 4)[:-1]), m1[0]

    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(two.weights_dir(2), dtype=torch.float32)
    # The published checkpoint keeps the tied embedding tied.
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()

    def gap(model):  # positive advantage for GOOD, negative for BAD
        return completion_logprob(model, GOOD) - completion_logprob(model, BAD)
    assert gap(trained) > gap(base) + 0.5


def test_killed_after_a_checkpoint_and_resumed_matches_an_uninterrupted_run(tmp_path, uninterrupted):
    """Deterministic settings (fp32, one thread per rank): checkpoint at step 3, killed while
    waiting for batch 6, resumed: steps 4 and 5 are trained again from the batches kept on disk
    (keep_rollouts = 1 alone would have deleted batch 4) and step 6's weights equal the
    uninterrupted run's, so model, optimizer moments and LR schedule all came back."""
    whole, cut = uninterrupted, RunDir(tmp_path / "cut")

    def cfg(run, name):
        return shared_args(tmp_path, run, name)

    write_batches(cut, range(1, 6))  # batch 6 not there yet: the trainer waits for it after step 5
    proc = subprocess.Popen(torchrun(2) + cfg(cut, "cut"), env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not (cut.metrics.exists() and [m["step"] for m in trainer_metrics(cut)][-1:] == [5]):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the trainer did not reach step 5"
            time.sleep(0.2)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    time.sleep(1)  # nothing of the killed run may still be alive to train batch 6 itself
    assert cut.checkpoint_steps("trainer") == [3] and not cut.weights_dir(6).exists()
    assert cut.rollout_steps() == [4, 5]  # what a resume from step 3 needs, and no more

    # Without --resume the trainer refuses the run directory; with it, it continues at step 4.
    refused = subprocess.run(rl_command("trainer", *cfg(cut, "cut")), capture_output=True, text=True,
                             timeout=120, env=ENV)
    assert refused.returncode != 0 and "--resume" in refused.stderr
    write_batches(cut, [6])
    log = run_trainer(torchrun(2), cfg(cut, "cut") + ["--resume"])
    assert "resumed from checkpoints/step_3: next batch is 4" in log, log[-3000:]

    a, b = weights(whole, 6), weights(cut, 6)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not torch.equal(weights(whole, 5)["model.norm.weight"], a["model.norm.weight"])
    # Steps 4 and 5 trained again, but recorded once: one record per step across the restart.
    assert [m["step"] for m in trainer_metrics(cut)] == [1, 2, 3, 4, 5, 6]
    assert trainer_metrics(cut)[-1]["lr"] == trainer_metrics(whole)[-1]["lr"]


def test_sharded_weights_load_as_one_model(tmp_path):
    from trainer.weights import write_weights

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    run = RunDir(tmp_path / "run")
    run.make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    write_weights(run, 1, state, TINY_MODEL, tied=True, shard_bytes=200_000)
    out = run.weights_dir(1)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").exists() and (out / "STABLE").exists()
    assert all(p.stat().st_size < 200_000 + 70_000 for p in shards)  # one tensor may overflow a shard alone
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_learning_rate_schedules():
    from trainer.optim import lr_factor

    cos = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    # Steps 1, 2 warm up; steps 3..6 decay from 1 to 0.1 (max_steps 6).
    got = [lr_factor(i, cos, 6) for i in range(6)]
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0, 1 / 3, 2 / 3, 1)]
    assert got == pytest.approx(want)
    lin = OptimConfig(lr=1.0, schedule="linear")
    assert [lr_factor(i, lin, 5) for i in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [lr_factor(i, OptimConfig(lr=1.0, warmup_steps=4), 9) for i in range(6)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_reference_kl_sequence_ratio_and_bfloat16_run_through_the_real_trainer(tmp_path, write_toml):
    """The options the loss tests check in isolation, wired through the program: a frozen
    reference model (KL is 0 at step 1, where trainer == reference, and > 0 after it moved),
    sequence-level truncated IS, ratio masks, Dr. GRPO normalisation, padded micro-batches, bf16
    compute; and, with servers holding bfloat16 (inference.dtype), each version published in
    bfloat16: the float32 master weights rounded as a server would round them on load."""
    run = RunDir(tmp_path / "run")
    write_batches(run, [1, 2, 3])
    extra = ("max_steps = 3\n[inference]\ndtype = \"bfloat16\"\n"
             "[checkpoints]\nevery = 3\n[trainer]\nbatching.pack = false\nbatching.micro_batch_size = 3\nmodel.dtype = \"bfloat16\"\n"
             "[trainer.optim]\nlr = 1e-3\n[trainer.loss]\nobjective = \"truncated_is\"\nratio_level = \"sequence\"\n"
             "mask_low = 0.1\nmask_high = 1.02\nkl_coef = 0.1\nkl_target = \"reference\"\nnormalization = \"constant\"\n")
    run_trainer(rl_command("trainer"), ["@", config(write_toml, run, "cfg.toml"),
                                        "@", str(write_toml(extra, "extra.toml")), "--max_steps", "3"])
    m = trainer_metrics(run)
    assert [r["step"] for r in m] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in m)
    assert m[0]["kl"] < 1e-4 < m[2]["kl"]
    assert 0 < m[0]["entropy"] < math.log(30)  # vocab of 30
    # Once the policy moved, some samples' sequence ratios leave [0.1, 1.02] and are masked whole
    # (at step 2, 3 or both: which depends on the model's weights).
    assert max(r["masked_frac"] for r in m[1:]) > 0 and all(r["masked_frac"] < 1 for r in m)
    published = load_file(run.weights_dir(3) / "model.safetensors")
    master = checkpoint_state(run, 3)
    assert published.keys() <= master.keys() and len(published) >= len(master) - 1  # a tied lm_head is left out
    for name, tensor in published.items():
        assert tensor.dtype == torch.bfloat16 and master[name][0].dtype == torch.float32, name
        assert torch.equal(tensor, master[name][0].to(torch.bfloat16)), name


@pytest.mark.parametrize("pack", [True, False])
def test_each_sample_is_scored_at_its_own_temperature_by_the_real_trainer(tmp_path, write_toml, pack):
    """One batch mixing samples drawn at temperatures 0.5, 1.0 and 1.5, each with the base
    model's logprobs at its own temperature (what the engine reports): step 1 is on-policy, so
    the trainer agrees with the "engine" only if it scores each sample at that sample's own
    temperature (any one batch-wide temperature puts mismatch_kl orders of magnitude higher)."""
    from float32_rounding import k3, logits_and_gap

    run = RunDir(tmp_path / "run")
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    bounds = []  # per loss token: how far float32 rounding may move its logprob between programs

    def sample(completion, adv, temperature):
        ids = torch.tensor([PROMPT + completion])
        logits, gap = logits_and_gap(base, input_ids=ids)
        logp = torch.log_softmax(logits[0, :-1] / temperature, -1)
        per_token = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(PROMPT) - 1:].tolist()
        # The trainer's logits are another float32 implementation's: within gap of these, so its
        # logprob (the token's scaled logit and the normaliser) within 2 * gap / temperature.
        bounds.extend((2 * gap[0, :-1] / temperature)[len(PROMPT) - 1:].tolist())
        return single_turn(PROMPT, completion, per_token, [0] * len(completion), reward=0.5 + adv,
                                  advantage=adv, temperature=temperature)
    samples = [sample(c, a, t) for t in (0.5, 1.0, 1.5) for c, a in ((GOOD, 0.5), (BAD, -0.5), (LONG, 0.25))]
    write_batch(Batch.from_samples(1, samples), run.rollout_dir(1))
    extra = f"[trainer.batching]\npack = {str(pack).lower()}\nmicro_batch_size = 4\n"
    run_trainer(rl_command("trainer"), ["@", config(write_toml, run, "cfg.toml"),
                                        "@", str(write_toml(extra, "extra.toml")), "--max_steps", "1"])
    (m,) = trainer_metrics(run)
    # Each token's log ratio within its bound b: mismatch_kl (mean k3) at most the mean k3(b),
    # ratio_mean (mean e^d) between the means of e^-b and e^b. (A sample scored at another
    # sample's temperature is off by ~0.1 to 1 a token: k3 1e-2 and more, far above.)
    b = torch.tensor(bounds, dtype=torch.float64)
    assert len(bounds) == sum(len(c) for c in (GOOD, BAD, LONG)) * 3
    assert m["mismatch_kl"] <= float(k3(b).mean()), (m, float(k3(b).mean()))
    assert float(torch.exp(-b).mean()) <= m["ratio_mean"] <= float(torch.exp(b).mean()), m


def test_chunked_logprobs_and_an_offloaded_reference_train_as_the_plain_trainer_does(tmp_path, write_toml):
    """trainer.model.logits_chunk_tokens (the head of trainer/logprob_head.py inside FSDP2's root
    forward, tied embeddings) and trainer.model.reference_offload (FSDP2 CPU offload of the KL
    reference; on this CPU-only machine the code path, not the memory), at a step where the
    policy has moved away from the reference: a full-logits run trains steps 1-3 (lr 1e-2, KL
    term on), and each variant resumes from its step-2 checkpoint for step 3. Step 3's
    KL is clearly nonzero, and each run's equals the KL computed in float64 (transformers, the
    published step-2 weights against the base model, over batch 3's completions) to within what
    float32 rounding of the logprobs allows; loss, gradient norm, entropy, mismatch KL and ratio
    equal the full-logits run's. (Each variant resumes from the one checkpoint: runs trained
    apart would compare step 3 from weights that Adam's first step already set apart by
    rounding, an entry with a near-zero gradient moving by lr either way.)"""
    variants = {"full": "logits_chunk_tokens = 0", "chunked": "logits_chunk_tokens = 3",
                "offloaded": "logits_chunk_tokens = 3\nreference_offload = true"}  # [trainer.model]
    lr, coef = 1e-2, 0.1

    def train(name: str, args: list[str]) -> str:
        run = RunDir(tmp_path / name)
        extra = (f"[trainer.model]\n{variants[name]}\n[trainer.optim]\nlr = {lr}\n"
                 f"[trainer.loss]\nkl_coef = {coef}\nkl_target = \"reference\"\n")
        stderr = run_trainer(rl_command("trainer"), ["@", config(write_toml, run, f"{name}.toml"),
                                                     "@", str(write_toml(extra, f"{name}_extra.toml"))] + args)
        assert "changes its logits" not in stderr
        return stderr

    full = RunDir(tmp_path / "full")
    write_batches(full, [1, 2, 3])
    batch3 = Batch.read(full.rollout_dir(3))
    # Steps 1-3 in one process (a third trainer start, not a fourth: a resume from the step-2
    # checkpoint restores the same state, RNG included), checkpointed at 2 and at its last step.
    train("full", ["--max_steps", "3", "--checkpoints.every", "2"])
    assert full.checkpoint_steps("trainer") == [2, 3]
    for name in ("chunked", "offloaded"):
        # The run as it was after step 2: step 3's checkpoint, version and record taken out.
        run = RunDir(tmp_path / name)
        shutil.copytree(full.root, run.root)
        shutil.rmtree(run.checkpoint_dir(3))
        shutil.rmtree(run.weights_dir(3))
        lines = run.metrics.read_text().splitlines(keepends=True)
        run.metrics.write_text("".join(line for line in lines if json.loads(line)["step"] != 3))
        assert run.checkpoint_steps("trainer") == [2] and run.rollout_steps()[-1] == 3
    metrics = {}
    for name in variants:
        if name != "full":
            log = train(name, ["--max_steps", "3", "--resume"])
            assert "resumed from checkpoints/step_2: next batch is 3" in log, log[-3000:]
        m = trainer_metrics(RunDir(tmp_path / name))
        assert [r["step"] for r in m] == [1, 2, 3]
        metrics[name] = m[-1]

    # Step 3's KL(policy || reference) in float64: per loss token x = ref_lp - lp, k3(x) =
    # exp(x) - x - 1, averaged. A float32 logprob is off by at most twice the worst logit error
    # of its position (tests/float32_rounding.py).
    from float32_rounding import U as u
    from float32_rounding import float64_logprobs
    from trainer.loss import _MAX_LOG_RATIO

    def float64_model(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).double().eval()

    def logprobs_and_errors(model, ids):
        lp, bound = float64_logprobs(model, ids)
        targets = torch.tensor(ids[1:])
        return lp[:-1][torch.arange(len(targets)), targets], 2 * bound[:-1]

    policy, reference = float64_model(full.weights_dir(2)), float64_model(TINY_MODEL)  # loaded once, not per sample
    ks, bounds = [], []
    for s in batch3.sample_slices():
        ids, mask = batch3.tokens[s].tolist(), batch3.loss_mask[s].tolist()
        pol, pol_err = logprobs_and_errors(policy, ids)
        ref, ref_err = logprobs_and_errors(reference, ids)
        for t in range(1, len(ids)):
            if mask[t]:
                # Clamped as the loss clamps it (1-Lipschitz: the error bound below still holds).
                x = min(max(float(ref[t - 1] - pol[t - 1]), -_MAX_LOG_RATIO), _MAX_LOG_RATIO)
                e = float(ref_err[t - 1] + pol_err[t - 1])
                ks.append(math.exp(x) - x - 1)
                # |k3(x + e) - k3(x)| = |(exp(x) - 1)(exp(e) - 1) + exp(e) - 1 - e|, and k3's own
                # float32 evaluation adds at most a few u of exp(x) + |x| + 1.
                bounds.append(abs(math.exp(x) - 1) * math.expm1(e) + (math.expm1(e) - e)
                              + 4 * u * (math.exp(x) + abs(x) + 1))
    n = len(ks)
    kl, bound = sum(ks) / n, sum(bounds) / n + n * u * sum(ks) / n  # plus the float32 sum over n tokens
    assert kl > 10 * bound, (kl, bound)  # the policy moved: a KL well clear of the rounding bound
    plain = metrics["full"]
    assert plain["loss_tokens"] == n and n > 3 * 2  # more loss tokens than two chunks' worth
    for name, m in metrics.items():
        assert abs(m["kl"] - kl) <= bound, (name, m["kl"], kl, bound)
    # Float32 sums of up to tokens x vocab terms in another order: relative error tokens * 30 * eps.
    tol = n * 30 * u
    for name in ("chunked", "offloaded"):
        assert metrics[name]["loss_tokens"] == n
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "ratio_mean"):
            assert metrics[name][key] == pytest.approx(plain[key], rel=tol, abs=1e-7), (name, key)
