"""A vision-language policy under `rl run` (issue 62): real vLLM, the real trainer and the real
orchestrator on models/tiny-vlm and the shapes task (tasks/shapes.py), each row a picture. The
images ride from the row through /generate, the group and the batch (PNG bytes) into the
trainer's forward; bad image rows are skipped, named and counted while the run goes on.

The check that the trainer sees what the engine saw: every token sampled at version 0 has, as
its engine logprob, the float64 transformers logprob of that id given the sample's ids and the
batch's images, within float32 rounding's bound for the whole path (the vision tower, the
connector, the language model: vlm_logit_error below, derived as tests/float32_rounding.py
derives the text models'); the same comparison with another sample's picture misses that bound
on most tokens, so a trainer given the wrong (or no) image would show. The trainer's own
mismatch_kl at step 1 (on-policy: both at version 0) is within the k3 of the bound for two
float32 programs.
"""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest
import torch

from conftest import ROOT, free_port, rl_command
from float32_rounding import LAYERS, U, WIDEST
from rl.batch import Batch
from rl.rundir import RunDir
from test_vlm_prompts import data_url, encoded, part, picture

pytestmark = pytest.mark.slow

MODEL = ROOT / "models" / "tiny-vlm"
VISION_LAYERS = 2  # models/tiny-vlm/config.json vision_config.num_hidden_layers (widths 64, 128 < WIDEST)


def vlm_logit_error() -> float:
    """tests/float32_rounding.py's logit_error(6) with the vision path chained in front: each
    image token's hidden state is the patch embedding (192 terms), 2 encoder layers (6 chained
    products each, as a decoder layer), the connector's projection (256 terms), then the
    language model's 4 layers and the head; every width at most WIDEST."""
    chained = LAYERS * 6 + VISION_LAYERS * 6 + 2 + 1
    return chained * WIDEST * U / (1 - chained * WIDEST * U)


def bad_rows(tmp) -> list[tuple[dict, str]]:
    """(row, what its skip line says): each of issue 62's bad inputs."""
    outside = tmp / "elsewhere"
    outside.mkdir()
    (outside / "x.png").write_bytes(encoded(picture(8, 8)))
    bomb = picture(1, 1).convert("1").resize((9000, 9000))  # 81M pixels declared, a small PNG

    def row(*urls):
        return {"messages": [{"role": "user", "content": [*map(part, urls), {"type": "text", "text": "How many?"}]}],
                "answer": "1"}
    return [(row(str(tmp / "data" / "gone.png")), "gone.png"),
            (row(str(outside / "x.png")), "outside the run's roots"),
            (row(data_url(bomb)), "decompression bomb"),
            (row(*[data_url(picture(8, 8))] * 5), "5 images, more than the 4")]


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    from tasks.shapes import make_row

    tmp = tmp_path_factory.mktemp("vlm_run")
    (tmp / "data").mkdir()
    good = [make_row(random.Random(f"test/{i}")) for i in range(8)]
    bad = bad_rows(tmp)
    rows = good[:4] + [r for r, _ in bad] + good[4:]
    (tmp / "data" / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "out"
    cfg = tmp / "run.toml"
    cfg.write_text(f'model = "{MODEL}"\noutput_dir = "{out}"\nmax_steps = 3\nseq_len = 96\nmax_async_level = 1\n'
                   f'[inference]\nport = {free_port()}\ndtype = "float32"\n'
                   "[orchestrator]\nscheduling.prompts_per_step = 4\nscheduling.group_size = 4\n"
                   "scheduling.filter_zero_variance = false\nsampling.max_tokens = 8\n"
                   f'[[orchestrator.datasets]]\npath = "{tmp / "data" / "shapes.jsonl"}"\nreward = "tasks.shapes:reward"\n'
                   "[trainer]\nfiles.keep_rollouts = 5\ntorch_threads = 1\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), capture_output=True, text=True, timeout=600, cwd=tmp)
    log = (out / "logs" / "orchestrator.log").read_text(errors="replace") if (out / "logs").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log[-3000:]
    return {"run": RunDir(out), "bad": bad, "log": log, "rows": rows}


def records(run: RunDir, program: str) -> list[dict]:
    return [r for r in map(json.loads, run.metrics.read_text().splitlines()) if r["program"] == program]


def test_bad_image_rows_are_named_skipped_and_counted_while_the_run_goes_on(vlm_run):
    orch = records(vlm_run["run"], "orchestrator")
    assert [r["step"] for r in orch] == [1, 2, 3]
    skipped = sum(r["skipped_image_rows"] for r in orch)
    # 12 good groups take 1.5 passes over the 8 good rows: every bad row is drawn at least once.
    assert skipped >= len(vlm_run["bad"]) and sum(r["skipped_rows"] for r in orch) == skipped
    lines = [line for line in vlm_run["log"].splitlines() if "row skipped:" in line]
    for k, (_, says) in enumerate(vlm_run["bad"]):
        where = f"shapes.jsonl row {4 + k}"
        mine = [line for line in lines if where in line]
        assert len(mine) == 1 and says in mine[0], (where, says, lines)  # once, naming row and culprit


def float64_model():
    from transformers import Idefics3ForConditionalGeneration

    from trainer.vision import vision_for

    model = Idefics3ForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float64, attn_implementation="eager")
    return vision_for(model.eval(), MODEL)


def exact_logprobs(vision, ids: list[int], images: list[bytes], sampled) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logprobs [T-1, V] of ids with these images, and each position's logit scale
    max_v sum_j |E_vj h_j| (the float32 bound's factor). `sampled`: where the engine sampled
    the token (a sampled <image> is text to it)."""
    head = vision.model.get_output_embeddings()
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append((i[0][0].abs() @ m.weight.abs().T).amax(-1)))
    pixels = vision.pixels
    vision.pixels = lambda png: {k: v.double() if v.is_floating_point() else v for k, v in pixels(png).items()}
    try:
        with torch.no_grad():
            logits = vision.logits(torch.tensor([ids]), torch.arange(len(ids))[None], images,
                                   torch.as_tensor(np.asarray(sampled) >= 0)[None])[0]
    finally:
        hook.remove()
        vision.pixels = pixels
    return logits[:-1].log_softmax(-1), seen[-1][:-1]


def test_the_trainer_scores_the_ids_and_pictures_the_engine_sampled_with(vlm_run):
    run = vlm_run["run"]
    vision = float64_model()
    error = vlm_logit_error()
    compared = moved = 0
    bounds, engine, trainer = [], [], []
    for step in (1, 2, 3):
        batch = Batch.read(run.rollout_dir(step))
        assert batch.has_images
        slices = batch.sample_slices()
        for i, s in enumerate(slices):
            images = batch.sample_images(i)
            assert len(images) == 1  # each shapes row: one picture, carried as its PNG
            other = batch.sample_images((i + 4) % batch.num_samples)  # another group's picture
            tokens, lps = batch.tokens[s].tolist(), batch.logprobs[s]
            mask, versions = batch.loss_mask[s], batch.token_versions[s]
            if not any(mask[t] and versions[t] == 0 for t in range(len(tokens))):
                continue
            lp, scale = exact_logprobs(vision, tokens, images, versions)
            wrong = exact_logprobs(vision, tokens, other, versions)[0] if other != images else None
            for t in range(1, len(tokens)):
                if not mask[t] or versions[t] != 0:
                    continue
                tol = 2 * error * float(scale[t - 1]) + abs(float(lps[t])) * U
                assert abs(float(lps[t]) - float(lp[t - 1, tokens[t]])) <= tol, (step, i, t, float(lps[t]),
                                                                                   float(lp[t - 1, tokens[t]]), tol)
                compared += 1
                if wrong is not None:
                    moved += abs(float(lps[t]) - float(wrong[t - 1, tokens[t]])) > tol
                if step == 1:
                    bounds.append(2 * tol)  # two float32 programs: the engine's and the trainer's
    assert compared >= 16, compared
    assert moved > compared // 2, (moved, compared)
    # The trainer's step 1 (on-policy): each token's log ratio within its bound, so mismatch_kl
    # (mean k3 over loss tokens) within the mean k3 of the bounds.
    (first, *_) = records(run, "trainer")
    b = np.asarray(bounds)
    assert first["step"] == 1 and first["mismatch_kl"] <= float(np.mean(np.exp(b) - b - 1)), (first, len(b))
    assert [r["step"] for r in records(run, "trainer")] == [1, 2, 3]


def test_weights_published_each_step_reload_in_the_server(vlm_run):
    run = vlm_run["run"]
    for n in (1, 2, 3):
        assert (run.weights_dir(n) / "STABLE").exists()
    versions = {v for step in (1, 2, 3) for v in Batch.read(run.rollout_dir(step)).token_versions.tolist() if v >= 0}
    assert max(versions) >= 1, versions  # batches sampled after a reload of the VLM's weights
