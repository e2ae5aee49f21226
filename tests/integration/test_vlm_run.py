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

The run samples with top_k and top_p and records the sampler's kept sets
(orchestrator.sampling.record_kept_sets), and updates the weights in flight
(scheduling.in_flight_updates: mode "keep"), as a text run may: the engine's logprobs are then
processed (renormalised over each token's kept set), so the comparison above is over the recorded
set (what the trainer replays); the trainer's rebuilt sets (the sampling mask without recorded
sets) are checked against float32 rounding's sure and possible sets, and the trainer program runs
step 1's batch both ways (test_the_trainer_program_rebuilds_...). The in-flight update of image
requests at the token level is tests/inference/test_vlm_inference.py's (test_zzz_...).
"""

from __future__ import annotations

import json
import random
import subprocess

import numpy as np
import pytest
import torch

from conftest import free_port, rl_command
from float32_rounding import U
from rl.batch import Batch
from rl.rundir import RunDir
from vlm_checks import MODEL, exact_logits, float64_model, records, vlm_logit_error
from vlm_pictures import data_url, encoded, part, picture

pytestmark = pytest.mark.slow

# Truncated sampling with the sampler's kept sets recorded (at most top_k + 1 ids: within
# inference.max_logprobs 20): the trainer replays them; without them it rebuilds them.
TOP_K, TOP_P = 8, 0.9


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
                   "scheduling.filter_zero_variance = false\nscheduling.in_flight_updates = true\n"
                   f"sampling.max_tokens = 8\nsampling.top_k = {TOP_K}\nsampling.top_p = {TOP_P}\n"
                   "sampling.record_kept_sets = true\n"
                   f'[[orchestrator.datasets]]\npath = "{tmp / "data" / "shapes.jsonl"}"\nreward = "tasks.shapes:reward"\n'
                   "[trainer]\nfiles.keep_rollouts = 5\ntorch_threads = 1\n")
    result = subprocess.run(rl_command("run", "@", str(cfg)), capture_output=True, text=True, timeout=600, cwd=tmp)
    log = (out / "logs" / "orchestrator.log").read_text(errors="replace") if (out / "logs").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + log[-3000:]
    return {"run": RunDir(out), "bad": bad, "log": log, "rows": rows}


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


def renormalised(logits: torch.Tensor, keep: torch.Tensor, token: int) -> float:
    """log p(token) over the kept set only (the sampler's processed logprob; the trainer's masked one)."""
    return float(logits[token] - torch.logsumexp(logits[keep], 0))


def recorded_sets(batch: Batch) -> list[list[int]]:
    """Each token's kept set as the sampler recorded it (rl/batch.py: kept_counts, kept_ids)."""
    ends = np.cumsum(batch.kept_counts)
    return [batch.kept_ids[e - c:e].tolist() for c, e in zip(batch.kept_counts.tolist(), ends.tolist())]


class Compared:
    """What test_the_trainer_scores_... counts over the version-0 loss tokens."""

    def __init__(self):
        self.tokens = self.moved = self.exact = self.rebuilt_moved = 0
        self.bounds: list[float] = []  # step 1's, per token: the replayed logprobs' two-program bound
        self.rebuilt_bounds: list[float] = []  # and the rebuilt sets' (spread added)
        self.spread, self.last_may_miss, self.may_miss = 0.0, False, 0


def check_token(c: Compared, logits, wrong, tol: float, gap: float, engine: float, token: int, kept: list[int]) -> None:
    """One loss token sampled at version 0: the engine's logprob is the exact one over the set
    it recorded (the trainer's replay) within `tol`; the recorded set and the trainer's rebuild
    (trainer/sampling_mask.py kept_mask) lie between the tokens surely and possibly kept under
    the engine's rounding (`gap` on each logit), equal where those coincide, and the rebuilt
    set's logprob within `tol` + the spread of those sets' masses. With another picture
    (`wrong`), the replayed logprob and the rebuilt set move."""
    from float32_rounding import kept_bounds

    from trainer.sampling_mask import kept_mask

    keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
    keep[kept] = True
    assert token in kept and len(kept) <= TOP_K + 1, (token, kept)
    replayed = renormalised(logits, keep, token)
    assert abs(engine - replayed) <= tol, (engine, replayed, tol)
    surely, possibly = kept_bounds(logits, gap, TOP_K, TOP_P)
    assert bool((surely <= keep).all() and (keep <= possibly).all()), (kept, surely.nonzero(), possibly.nonzero())
    settings = (torch.tensor([TOP_K]), torch.tensor([TOP_P]), torch.zeros(1))
    rebuilt = kept_mask(logits.float()[None], *settings)[0]
    assert bool((surely <= rebuilt).all() and (rebuilt <= possibly).all())
    c.last_may_miss = not bool(surely[token])  # a rebuilt set may miss the sampled token only here
    surely[token] = possibly[token] = rebuilt[token] = True  # the trainer adds the sampled token back
    if torch.equal(surely, possibly):
        assert torch.equal(rebuilt, keep)
        c.exact += 1
    lse = {name: float(torch.logsumexp(logits[m], 0)) for name, m in (("surely", surely), ("possibly", possibly),
                                                                        ("recorded", keep))}
    spread = lse["possibly"] - lse["surely"]
    assert abs(engine - renormalised(logits, rebuilt, token)) <= tol + spread
    # The trainer's own rebuilt set, also between the two, against the engine's (the recorded one):
    # their normalisers differ by at most this.
    c.spread = max(lse["possibly"] - lse["recorded"], lse["recorded"] - lse["surely"])
    c.tokens += 1
    if wrong is not None:
        c.moved += abs(engine - renormalised(wrong, keep, token)) > tol
        c.rebuilt_moved += not torch.equal(kept_mask(wrong.float()[None], *settings)[0] | (torch.arange(len(keep)) == token),
                                           keep)


@pytest.fixture(scope="module")
def scored(vlm_run) -> Compared:
    """Every loss token sampled at version 0, checked (check_token) against float64 transformers
    with the batch's ids and PNGs."""
    run = vlm_run["run"]
    vision = float64_model()
    error = vlm_logit_error()
    c = Compared()
    for step in (1, 2, 3):
        batch = Batch.read(run.rollout_dir(step))
        assert batch.has_images
        kept_sets = recorded_sets(batch)
        for i, s in enumerate(batch.sample_slices()):
            images = batch.sample_images(i)
            assert len(images) == 1  # each shapes row: one picture, carried as its PNG
            other = batch.sample_images((i + 4) % batch.num_samples)  # another group's picture
            tokens, lps = batch.tokens[s].tolist(), batch.logprobs[s]
            mask, versions, kept = batch.loss_mask[s], batch.token_versions[s], kept_sets[s]
            if not any(mask[t] and versions[t] == 0 for t in range(len(tokens))):
                continue
            logits, scale = exact_logits(vision, tokens, images, versions)
            wrong = exact_logits(vision, tokens, other, versions)[0] if other != images else None
            for t in range(1, len(tokens)):
                if not mask[t] or versions[t] != 0:
                    continue
                gap = error * float(scale[t - 1])
                tol = 2 * gap + abs(float(lps[t])) * U
                check_token(c, logits[t - 1], None if wrong is None else wrong[t - 1], tol, gap, float(lps[t]),
                            tokens[t], kept[t])
                if step == 1:
                    c.bounds.append(2 * tol)  # two float32 programs: the engine's and the trainer's
                    c.rebuilt_bounds.append(2 * tol + c.spread)
                    c.may_miss += c.last_may_miss
    return c


def test_the_trainer_scores_the_ids_and_pictures_the_engine_sampled_with(vlm_run, scored):
    """Every loss token sampled at version 0 (check_token): the engine's logprob, processed over
    its top_k/top_p kept set, is float64 transformers' over the set it recorded, with the batch's
    ids and PNGs; the trainer's replayed and rebuilt sets give it; another sample's picture
    misses it. The trainer program replayed every truncated token's recorded set, missed none,
    and its step-1 mismatch_kl is within the mean k3 of the two-program bounds."""
    run, c = vlm_run["run"], scored
    assert c.tokens >= 16 and c.exact >= c.tokens // 4, (c.tokens, c.exact)
    assert c.moved > c.tokens // 2 and c.rebuilt_moved > 0, (c.moved, c.rebuilt_moved, c.tokens)
    # The trainer's step 1 (on-policy): each token's log ratio within its bound, so mismatch_kl
    # (mean k3 over loss tokens) within the mean k3 of the bounds; every truncated token replayed.
    first, *rest = records(run, "trainer")
    assert first["step"] == 1 and first["mismatch_kl"] <= k3_mean(c.bounds), (first, len(c.bounds))
    assert [r["step"] for r in [first, *rest]] == [1, 2, 3]
    for r in (first, *rest):
        assert r["truncated_frac"] == 1.0 and r["sampling_mask_replayed_frac"] == 1.0, r
        assert r["sampling_mask_miss_frac"] == 0.0, r
    print(f"\n{c.tokens} tokens: replayed within the bound, {c.exact} rebuilt sets exactly the sampler's; another "
          f"picture: {c.moved} replayed logprobs and {c.rebuilt_moved} rebuilt sets off")


def trainer_step_on(batch: Batch, tmp_path, name: str) -> dict:
    """One step of `rl trainer` (tiny-vlm's base weights) on `batch`: its metrics record."""
    from conftest import rl_command
    from samples import write_batch
    from trainer_runs import run_trainer, trainer_metrics

    run = RunDir(tmp_path / name)
    write_batch(batch, run.rollout_dir(1))
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(f'model = "{MODEL}"\noutput_dir = "{run.root}"\nmax_steps = 1\nseq_len = 96\n'
                   "[trainer]\ntorch_threads = 1\n")
    run_trainer(rl_command("trainer"), ["@", str(cfg)])
    (m,) = trainer_metrics(run)
    return m


def k3_mean(bounds: list[float]) -> float:
    """The mean of trainer/loss.py's per-token mismatch_kl, exp(x) - x - 1, at |x| at most each bound."""
    b = np.asarray(bounds)
    return float(np.mean(np.exp(b) - b - 1))


def test_the_trainer_program_rebuilds_the_kept_sets_of_image_samples(vlm_run, scored, tmp_path):
    """The sampling mask without recorded sets: step 1's batch with its kept sets dropped, one
    step of `rl trainer` from the same weights. It rebuilds every truncated token's set from its
    own logits (with the pictures): replayed 0, a miss only where the sampled token is not surely
    kept, and mismatch_kl within the mean k3 of each token's bound (two float32 programs, and
    how far a set between those surely and possibly kept may move the normaliser:
    scored.rebuilt_bounds). On this random model many tokens sit within rounding of a boundary,
    so that bound (~7e-3) is above what another picture does (~2.4e-3): the pictures are told
    apart by the replay, whose bound has no such term. The batch as recorded, each sample given
    the next group's picture: the replaying trainer's mismatch_kl is past the bound the run's
    own step 1 met (test_the_trainer_scores_...)."""
    recorded = Batch.read(vlm_run["run"].rollout_dir(1))
    batch = Batch.read(vlm_run["run"].rollout_dir(1))
    assert int(batch.kept_counts.sum()) > 0
    batch.kept_counts = np.zeros_like(batch.kept_counts)
    batch.kept_ids = batch.kept_ids[:0]
    bound = k3_mean(scored.rebuilt_bounds)
    m = trainer_step_on(batch, tmp_path, "rebuilt")
    assert m["truncated_frac"] == 1.0 and m["sampling_mask_replayed_frac"] == 0.0, m
    assert m["sampling_mask_miss_frac"] <= scored.may_miss / len(scored.rebuilt_bounds), (m, scored.may_miss)
    assert m["mismatch_kl"] <= bound, (m, bound)
    # One picture a sample (image_counts all 1): the next group's, bytes and sizes moved alike.
    assert recorded.image_counts.tolist() == [1] * recorded.num_samples
    order = [(i + 4) % recorded.num_samples for i in range(recorded.num_samples)]  # group_size 4
    pictures = [recorded.sample_images(j)[0] for j in order]
    recorded.image_sizes = np.asarray([len(p) for p in pictures], np.int64)
    recorded.image_bytes = np.frombuffer(b"".join(pictures), np.uint8).copy()
    swapped = trainer_step_on(recorded, tmp_path, "swapped")
    assert swapped["sampling_mask_replayed_frac"] == 1.0 and swapped["mismatch_kl"] > k3_mean(scored.bounds), swapped
    print(f"\nrebuilt sets: mismatch_kl {m['mismatch_kl']:.2e} (miss {m['sampling_mask_miss_frac']:.3f}, bound "
          f"{bound:.2e}); replayed with other pictures {swapped['mismatch_kl']:.2e} (bound {k3_mean(scored.bounds):.2e})")


def test_weights_published_each_step_reload_in_the_server(vlm_run):
    run = vlm_run["run"]
    for n in (1, 2, 3):
        assert (run.weights_dir(n) / "STABLE").exists()
    versions = {v for step in (1, 2, 3) for v in Batch.read(run.rollout_dir(step)).token_versions.tolist() if v >= 0}
    assert max(versions) >= 1, versions  # batches sampled after a reload of the VLM's weights
    for n in (1, 2, 3):  # max_async_level 1: batch n holds no token older than version n - 2
        sampled = [v for v in Batch.read(run.rollout_dir(n)).token_versions.tolist() if v >= 0]
        assert n - 2 <= min(sampled) and max(sampled) <= n - 1, (n, sorted(set(sampled)))
    # In flight ("keep"): the engine paused between two steps with image requests running, and lived.
    log = (run.root / "logs" / "inference.log").read_text(errors="replace")
    assert "(mode keep:" in log and "Encoder cache miss" not in log, log[-3000:]
