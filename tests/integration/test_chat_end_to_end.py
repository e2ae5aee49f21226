"""The chat path on real vLLM, the real trainer and orchestrator (`rl run`): a model with a
ChatML template whose eos is NOT its end-of-turn token (a base model with a template), a jsonl
dataset of chat messages mixed with a reasoning-gym task at another temperature, a held-out
evaluation before and after. What the trainer got is checked against transformers'
apply_chat_template and against where generation must stop."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import ROOT, free_port, rl_command
from float32_rounding import U, float64_logprobs
from rl.batch import Batch
from rl.rundir import RunDir
from tracker_files import scalars


pytestmark = pytest.mark.slow

CHAT_MODEL = ROOT / "models" / "tiny-chat"
USER = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)


def base_model_with_template(tmp_path):
    """The demo's chat model, told that its eos is <|endoftext|>: only the template says that a
    turn ends at <|im_end|>, so stopping there is the orchestrator's doing."""
    model = shutil.copytree(CHAT_MODEL, tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model)
    eos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    for name in ("generation_config.json", "config.json"):
        data = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**data, "eos_token_id": eos_id}))
    return model


def assert_the_promised_metrics(orch: list[dict], trainer: list[dict], samples: int) -> None:
    """What each per-step field means, checked on a real run's records."""
    for r in orch:
        assert sum(r["staleness_hist"].values()) == samples  # every sample of the batch, once
        assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= 1  # max_async_level 1
        assert 0 <= r["inference_idle_frac"] <= 1 and 0 <= r["trainer_wait_frac"] <= 1
        # Tokens generated since the previous batch: 0 when this batch's groups all finished
        # before that one was handed over (oversampling), never negative.
        assert r["tokens_per_s"] >= 0 and r["wait_s"] >= r["group_wait_s"] >= 0
        assert 0 <= r["truncated"] <= samples and r["skipped_rows"] == 0
        assert 0 <= r["reward_mean"] <= 1 and r["servers_in_rotation"] == 1
        assert all(r[k] == 0 for k in ("cancelled", "episodes_failed_scored", "failed_requests", "requeued"))
    assert orch[0]["tokens_per_s"] > 0
    assert [r["step"] for r in trainer] == [1, 2, 3]
    for r in trainer:
        assert 0 < r["loss_tokens"] <= r["tokens"] and r["step_s"] > 0 and r["trainer_tokens_per_s"] > 0
        assert r["grad_norm"] >= 0 and r["entropy"] >= 0 and 0 <= r["clipped_frac"] <= 1
        assert 0 <= r["masked_frac"] <= 1 and r["max_staleness"] in (0, 1) and r["wait_s"] >= 0


def chat_config(tmp_path, model, data) -> str:
    """Two datasets at two temperatures, a held-out evaluation, both trackers, every port free."""
    out = tmp_path / "run"
    return f'''model = "{model}"
output_dir = "{out}"
max_steps = 3
seq_len = 96
max_async_level = 1
[inference]
port = {free_port()}
dtype = "float32"
[orchestrator.scheduling]
prompts_per_step = 4
group_size = 4
max_in_flight_groups = 8
[orchestrator.sampling]
max_tokens = 16
[[orchestrator.datasets]]
path = "{data}"
reward = "spell_reward:reward"
reward_weights = {{ exact = 0.0 }}
[[orchestrator.datasets]]
reasoning_gym = "spell_backward"
task_config = {{ max_word_len = 8 }}
sampling = {{ temperature = 0.7, top_k = 20 }}
[orchestrator.eval]
rows = 8
[[orchestrator.eval.datasets]]
name = "heldout"
reasoning_gym = "spell_backward"
task_config = {{ max_word_len = 8 }}
seed = 10000
[checkpoints]
every = 0
[trainer.files]
keep_rollouts = 10
[tracking]
tensorboard = true
wandb = true
'''


def assert_rendered_prompts_and_stops(model, batches: list[Batch], words: list[str]) -> None:
    """Each prompt is apply_chat_template's ids for its question; generation stops at the end
    of the turn though eos is another token; each dataset's sampling rides with its samples."""
    tok = AutoTokenizer.from_pretrained(model)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ended = 0
    for batch in batches:
        for s, temperature, top_k in zip(batch.sample_slices(), batch.temperatures, batch.top_k):
            tokens, mask = batch.tokens[s].tolist(), batch.loss_mask[s].tolist()
            first = mask.index(1)
            prompt, completion = tokens[:first], tokens[first:]
            # The prompt: exactly apply_chat_template's ids for the question it holds.
            (question,) = USER.findall(tok.decode(prompt))
            assert prompt == tok.apply_chat_template([{"role": "user", "content": question}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
            # Generation stopped at the end of the turn, though eos is another token.
            assert im_end not in completion[:-1]
            ended += completion[-1] == im_end
            # Each dataset's sampling, recorded with its samples.
            reasoning_gym = question not in {f"Spell this word backward (example: sun -> nus): {w}" for w in words}
            assert (temperature, top_k) == ((np.float32(0.7), 20) if reasoning_gym else (1.0, -1))
    assert ended > 0  # the model was taught to end its turns: some did within 16 tokens


def assert_completions_are_the_sampled_ids(model, batches: list[Batch]) -> None:
    """The completions are the sampled ids: at version 0, the engine's logprob of each (the batch
    keeps it, float32) is the base model's logprob of that id at that place. Samples drawn at
    temperature 1 without truncation (the jsonl dataset's) report the plain log_softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).double().eval()
    compared = unique = 0
    for batch in batches:
        for i, s in enumerate(batch.sample_slices()):
            if (batch.temperatures[i], batch.top_k[i], batch.top_p[i], batch.min_p[i]) != (1.0, -1, 1.0, 0.0):
                continue
            tokens, mask = batch.tokens[s].tolist(), batch.loss_mask[s].tolist()
            engine_lp, versions = batch.logprobs[s].tolist(), batch.token_versions[s].tolist()
            lp, bound = float64_logprobs(base, tokens)
            err = 2 * bound  # a logprob: twice a logit's (tests/float32_rounding.py)
            for t in range(mask.index(1), len(tokens)):
                if not mask[t] or versions[t] != 0:
                    continue
                tol = float(err[t - 1]) + abs(engine_lp[t]) * U  # and the batch's float32 storage
                assert abs(engine_lp[t] - float(lp[t - 1, tokens[t]])) <= tol, \
                    (t, tokens[t], engine_lp[t], float(lp[t - 1, tokens[t]]), tol)
                compared += 1
                # Where no other id has that logprob, a trained id other than the sampled one fails.
                others = (lp[t - 1] - engine_lp[t]).abs() <= tol
                unique += int(others.sum()) == 1
    assert compared >= 16  # at least one sample's worth of 16 tokens at version 0
    assert unique > compared // 2, (unique, compared)  # 79 of 89 in one run


def test_a_chat_run_trains_on_exactly_the_rendered_and_sampled_ids(tmp_path):
    """Each trained prompt is apply_chat_template's ids for its question; each trained
    completion token is the id the engine sampled: at the base weights (version 0) the logprob
    the engine reported with it is the base model's own logprob of that very id at that place
    (float64 transformers, to within float32 rounding), which at most places no other id has (so
    a trained id other than the sampled one would show). Generation
    stops at the end of the turn though eos is another token; each dataset's sampling settings
    ride with its samples; the per-step metrics, evaluations, trackers and plots are there."""
    model = base_model_with_template(tmp_path)
    words = ["ammonia", "splat", "canroyer", "kettle", "orbit", "sun", "mirror", "lantern"]
    data = tmp_path / "spell.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Spell this word backward (example: sun -> nus): {w}"}], "answer": w[::-1]}) + "\n"
        for w in words))
    (tmp_path / "spell_reward.py").write_text(
        "def reward(prompt, completion, row):\n"
        "    right = sum(a == b for a, b in zip(completion.strip(), row['answer']))\n"
        "    return {'letters': right / len(row['answer']), 'exact': float(completion.strip() == row['answer'])}\n")
    out = tmp_path / "run"
    cfg = tmp_path / "chat.toml"
    cfg.write_text(chat_config(tmp_path, model, data))
    result = subprocess.run(rl_command("run", "@", str(cfg)), capture_output=True, text=True, timeout=420,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:] + (out / "logs" / "orchestrator.log").read_text()[-3000:]
    assert "held-out greedy heldout/accuracy: version 0" in result.stderr

    run = RunDir(out)
    batches = [Batch.read(run.rollout_dir(step)) for step in (1, 2, 3)]
    assert_rendered_prompts_and_stops(model, batches, words)
    assert_completions_are_the_sampled_ids(model, batches)

    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    orch = [r for r in records if r["program"] == "orchestrator"]
    assert len(orch) == 3 and all("truncated" in r and "skipped_rows" in r for r in orch)
    assert_the_promised_metrics(orch, [r for r in records if r["program"] == "trainer"], samples=4 * 4)
    assert {"reward/letters", "reward/exact", "reward_mean/spell", "reward_mean/spell_backward"} <= set().union(*orch)
    evals = [r for r in records if r["program"] == "eval"]
    assert [(r["step"], r["version"]) for r in evals] == [(0, 0), (3, 3)]
    assert all(r["eval/heldout/rows"] == 8 and 0 <= r["eval/heldout/accuracy"] <= 1 for r in evals)

    # The trackers got every program's records, the trainer's last one included (it lands after
    # the final version serves, when the orchestrator is about to stop).
    tb = scalars(out / "tracking" / "tensorboard")
    assert [s for s, _ in tb["orchestrator/reward_mean"]] == [1, 2, 3]
    assert [s for s, _ in tb["trainer/loss"]] == [1, 2, 3]
    assert tb["eval/heldout/accuracy"] == [(r["step"], pytest.approx(r["eval/heldout/accuracy"])) for r in evals]
    assert list((out / "tracking" / "wandb").glob("offline-run-*/run-*.wandb"))
    # rl run drew the run's plots at the end (asyncrl/plots.py).
    assert all((out / f"{name}.png").is_file() for name in ("reward_curve", "staleness", "throughput", "weight_updates"))
