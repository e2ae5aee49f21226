"""The real trainer on models/tiny-vlm over 2 FSDP2 ranks (gloo), batches with pictures (PNG
bytes in the batch, rl/batch.py): both the language model's and the vision tower's layers are
sharded (trainer/parallel.py shard_units), the pictures reach the forward on every rank, and
[trainer.vision] train_tower decides whether the vision tower moves: frozen (the default) it is
published bit for bit as loaded while the connector and the language model train."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, free_port
from rl.batch import Batch
from rl.rundir import RunDir
from samples import single_turn, write_batch
from trainer_runs import run_trainer, trainer_metrics

pytestmark = pytest.mark.slow

MODEL = ROOT / "models" / "tiny-vlm"


def image_samples(step: int) -> list:
    """Shapes rows rendered as the orchestrator renders them, a made-up completion each; one
    text-only sample among them (a batch may mix the two)."""
    from orchestrator.rendering import ChatTemplate
    from orchestrator.rendering.images import image_support, render_image_prompt
    from orchestrator.rendering.tokenizer import load_tokenizer
    from tasks.shapes import make_row

    template, support, tok = ChatTemplate.load(MODEL), image_support(MODEL), load_tokenizer(str(MODEL))
    out = []
    for i in range(5):
        row = make_row(random.Random(f"fsdp/{step}/{i}"))
        p = render_image_prompt(template, support, tok, row["messages"], [])
        completion = tok.encode(str(1 + i % 4), add_special_tokens=False).ids + [2]
        s = single_turn(p.token_ids, completion, [-1.5] * len(completion), [step - 1] * len(completion),
                        reward=float(i % 2), advantage=0.5 if i % 2 else -0.5)
        s.images = p.images
        out.append(s)
    text = tok.encode(template.render([{"role": "user", "content": "Count."}]), add_special_tokens=False).ids
    out.append(single_turn(text, [5, 6, 2], [-2.0] * 3, [step - 1] * 3, reward=1.0, advantage=0.5))
    return out


def train_two_ranks(tmp_path, write_toml, name: str, extra: str) -> RunDir:
    run = RunDir(tmp_path / name)
    for step in (1, 2):
        write_batch(Batch.from_samples(step, image_samples(step)), run.rollout_dir(step))
    cfg = write_toml(f'model = "{MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 2\nseq_len = 96\n'
                     "[trainer]\nbatching.micro_batch_tokens = 200\ntorch_threads = 1\n[trainer.optim]\nlr = 1e-2\n"
                     + extra, f"{name}.toml")
    run_trainer([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port()), "-m", "trainer"], ["@", str(cfg)])
    return run


def parts(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    groups = {"vision": {}, "connector": {}, "text": {}}
    for k, v in state.items():
        groups["vision" if ".vision_model." in k else "connector" if ".connector." in k else "text"][k] = v
    return groups


@pytest.mark.parametrize("train_tower", [False, True])
def test_two_ranks_train_a_vlm_with_the_vision_tower_frozen_or_trained(tmp_path, write_toml, train_tower):
    run = train_two_ranks(tmp_path, write_toml, f"tower_{train_tower}",
                          f"[trainer.vision]\ntrain_tower = {str(train_tower).lower()}\n")
    metrics = trainer_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2] and all(m["grad_norm"] > 0 for m in metrics), metrics
    base = parts(load_file(MODEL / "model.safetensors"))
    after = parts(load_file(run.weights_dir(2) / "model.safetensors"))
    assert after["vision"].keys() == base["vision"].keys() and after["vision"]
    vision_moved = [k for k in base["vision"] if not torch.equal(base["vision"][k], after["vision"][k])]
    if train_tower:
        assert len(vision_moved) > len(base["vision"]) // 2, vision_moved
    else:
        assert vision_moved == []
    for part in ("connector", "text"):
        moved = [k for k in base[part] if not torch.equal(base[part][k], after[part][k])]
        assert len(moved) > len(base[part]) // 2, (part, len(moved), len(base[part]))


def test_the_real_trainer_scores_each_sample_with_its_own_pictures(tmp_path, write_toml):
    """One rank, one step, on-policy by construction: each sample's loss tokens are its prompt's
    tokens after the picture, their "engine" logprobs float64 transformers' given that picture.
    The trainer's mismatch_kl is within the mean k3 of float32 rounding's bound
    (tests/integration/test_vlm_run.py vlm_logit_error); the same batch with the pictures rotated among the
    samples (what a trainer pairing images with the wrong samples would score) is far outside."""
    import numpy as np

    from float32_rounding import U

    from vlm_checks import exact_logprobs, float64_model, vlm_logit_error

    vision, error = float64_model(), vlm_logit_error()
    close = vision.image_token_id  # the last placeholder; the block then closes with one more token
    made, bounds = [], []
    for s in image_samples(1)[:5]:
        ids = s.tokens
        cut = max(i for i, t in enumerate(ids) if t == close) + 2  # after <fake_token_around_image>
        lp, scale = exact_logprobs(vision, ids, s.images, [-1] * len(ids))
        rest = ids[cut:]
        lps = [float(lp[t - 1, ids[t]]) for t in range(cut, len(ids))]
        bounds += [2 * error * float(scale[t - 1]) + abs(lps[t - cut]) * U for t in range(cut, len(ids))]
        x = single_turn(ids[:cut], rest, lps, [0] * len(rest), reward=1.0, advantage=0.0)
        x.images = s.images
        made.append(x)
    b = np.asarray(bounds)
    bound = float(np.mean(np.exp(b) - b - 1))
    kls = {}
    for name, images in (("own", [x.images for x in made]), ("rotated", [x.images for x in made[1:] + made[:1]])):
        run = RunDir(tmp_path / name)
        for x, im in zip(made, images):
            x.images = im
        write_batch(Batch.from_samples(1, made), run.rollout_dir(1))
        cfg = write_toml(f'model = "{MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 1\nseq_len = 96\n'
                         "[trainer]\nbatching.micro_batch_tokens = 200\ntorch_threads = 1\n", f"{name}.toml")
        run_trainer([sys.executable, "-m", "trainer"], ["@", str(cfg)])
        kls[name] = trainer_metrics(run)[0]["mismatch_kl"]
    assert kls["own"] <= bound < kls["rotated"], (kls, bound)
