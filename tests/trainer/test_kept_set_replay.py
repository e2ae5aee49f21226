"""Replayed kept sets (orchestrator.sampling.record_kept_sets): the sampler's own kept set of each token
travels in the batch and the trainer renormalises over exactly it, rebuilding only where none
was recorded. The engine side, against a real vLLM server: tests/trainer/test_sampling_mask.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from float32_rounding import log_softmax_error
from inference.kept_sets import kept_sets
from rl.batch import Batch, BatchError
from samples import single_turn
from trainer.data import loss_weights, rank_micro_batches
from trainer.logprob_head import _chunk
from trainer.loss import token_logprobs_and_entropy
from trainer.sampling_mask import Truncation, kept_mask

VOCAB = 12


def truncation(select: torch.Tensor, kept: torch.Tensor | None) -> Truncation:
    shape = select.shape
    return Truncation(torch.full(shape, 3), torch.full(shape, 0.9), torch.zeros(shape), select, kept=kept)


def test_a_replayed_set_replaces_the_rebuilt_one_and_positions_without_one_are_rebuilt():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, VOCAB)
    tokens = torch.randint(0, VOCAB, (1, 6))
    select = torch.tensor([[False, True, True, True, True]])
    # Positions 1 and 3 carry a recorded set (the sampled token and two others, not the top-3 of
    # these logits: a stale sampler's); 2 and 4 none (-1): rebuilt from top_k 3 / top_p 0.9.
    kept = torch.full((1, 5, 4), -1)
    for t in (1, 3):
        others = [i for i in range(VOCAB) if i != int(tokens[0, t + 1])][-2:]
        kept[0, t, :3] = torch.tensor([int(tokens[0, t + 1]), *others])
    trunc = truncation(select, kept)
    logprobs, _ = token_logprobs_and_entropy(logits, tokens, 1.0, trunc)
    rounding = log_softmax_error(VOCAB, float(logits.abs().max()))
    rebuilt = kept_mask(logits[0, :-1], *(x[0] for x in (trunc.top_k, trunc.top_p, trunc.min_p)))
    for t in range(1, 5):
        token = int(tokens[0, t + 1])
        if t in (1, 3):
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[kept[0, t, :3]] = True
            assert not torch.equal(keep, rebuilt[t])  # the replay is not the rebuild in disguise
        else:
            keep = rebuilt[t].clone()
            keep[token] = True
        # Exact (float64) against the trainer's float32 log_softmax: within its rounding.
        want = torch.log_softmax(logits[0, t].double().masked_fill(~keep, float("-inf")), -1)[token]
        assert abs(float(logprobs[0, t]) - float(want)) <= rounding, t
    assert trunc.replayed == 2.0
    # Position 0 is not selected: the full-vocabulary logprob.
    want = torch.log_softmax(logits[0, 0].double(), -1)[tokens[0, 1]]
    assert abs(float(logprobs[0, 0]) - float(want)) <= rounding


def test_the_chunked_head_replays_as_the_plain_path_does():
    """trainer/logprob_head.py's _chunk (the fused head) on the same rows: same logprobs, same
    misses and replayed counts."""
    torch.manual_seed(1)
    n = 8
    h = torch.randn(n, VOCAB)
    targets = torch.randint(0, VOCAB, (n,))
    select = torch.tensor([True] * 6 + [False] * 2)
    kept = torch.full((n, 3), -1)
    kept[:3, 0] = targets[:3]
    kept[:3, 1] = (targets[:3] + 1) % VOCAB
    kept[3, :2] = torch.tensor([(int(targets[3]) + 1) % VOCAB, (int(targets[3]) + 2) % VOCAB])  # a miss
    settings = (torch.full((n,), 3), torch.full((n,), 0.9), torch.zeros(n))
    lp, _, counts = _chunk(h, torch.eye(VOCAB), None, targets, torch.ones(n), Truncation(*settings, select, kept=kept))
    plain = Truncation(*(x[None] for x in settings), select[None], kept=kept[None])
    # token_logprobs_and_entropy predicts tokens[:, 1:] from logits[:, :-1]: shift by one.
    want, _ = token_logprobs_and_entropy(torch.cat([h, h[:1]])[None], torch.cat([targets[:1], targets])[None],
                                         1.0, plain)
    # Both float32 log_softmax of the same logits (h times the identity is exact): each within its rounding.
    assert ((lp - want[0]).abs() <= 2 * log_softmax_error(VOCAB, float(h.abs().max()))).all(), lp - want[0]
    assert counts.tolist() == [plain.misses, plain.replayed]
    rebuilt = kept_mask(h[4:6], *(x[4:6] for x in settings))
    assert plain.replayed == 4.0 and plain.misses == 1.0 + float((~rebuilt[torch.arange(2), targets[4:6]]).sum())


def test_the_batch_carries_kept_sets_to_the_predicted_positions_packed_or_padded():
    a = single_turn([1, 2], [3, 4, 5], [-0.1] * 3, [0] * 3, 0.0, 1.0, top_p=0.8, kept=[[3, 7], [4], [5, 6, 8]])
    b = single_turn([9], [10, 11], [-0.2] * 2, [0] * 2, 1.0, -1.0, top_p=0.8)  # none recorded
    batch = Batch.decode(*Batch.from_samples(1, [a, b]).encode(), "test")
    assert batch.kept_counts.tolist() == [0, 0, 2, 1, 3, 0, 0, 0]
    assert batch.kept_ids.tolist() == [3, 7, 4, 5, 6, 8]
    for row_len in (None, 16):
        mbs = rank_micro_batches(batch, 0, 1, row_len=row_len, per_micro_batch=2, pad_id=0,
                                 weights=loss_weights(batch, "token", 0))
        (mb,) = mbs
        seen = {}
        for r, t in (mb.loss_mask > 0).nonzero().tolist():
            token = int(mb.tokens[r, t + 1])
            seen[token] = sorted(x for x in mb.kept[r, t].tolist() if x >= 0)
        assert seen == {3: [3, 7], 4: [4], 5: [5, 6, 8], 10: [], 11: []}, (row_len, seen)
        off = mb.loss_mask == 0  # prompts, boundaries, padding: nothing recorded
        assert (mb.kept[off] == -1).all()


def test_a_batch_whose_kept_ids_do_not_add_up_is_refused_naming_them():
    a = single_turn([1, 2], [3, 4], [-0.1] * 2, [0] * 2, 0.0, 1.0, top_p=0.8, kept=[[3], [4]])
    with pytest.raises(ValueError, match="kept_counts"):
        Batch.from_samples(1, [single_turn([1], [3], [-0.1], [0], 0.0, 1.0)] +
                           [a.__class__(**{**a.__dict__, "kept_ids": [3]})])
    batch = Batch.from_samples(1, [a])
    batch.kept_ids = np.asarray([3], dtype=np.int32)
    with pytest.raises(BatchError, match="kept_ids"):
        Batch.decode(*batch.encode(), "the test's batch")


def logprob(value: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=value, rank=rank)


def test_a_set_is_read_whole_only_when_the_returned_logprobs_show_where_it_ends():
    inf = -math.inf
    ended = {4: logprob(-0.1, 1), 2: logprob(-2.5, 2), 7: logprob(inf, 3)}  # top 3 asked: a -inf shows the end
    full = {4: logprob(-0.1, 1), 2: logprob(-2.5, 2), 7: logprob(-3.0, 3)}  # all finite: may go on (a tie past top_k)
    whole_vocab = {0: logprob(-0.7, 1), 1: logprob(-0.7, 2), 2: logprob(inf, 3)}
    assert kept_sets([ended, full], asked=3, vocab=50) == [[2, 4], []]
    assert kept_sets([whole_vocab], asked=3, vocab=3) == [[0, 1]]


def reverse_run(write_toml, tmp_path, extra: str, orchestrator: str = "") -> str:
    from conftest import TINY_MODEL, free_port

    return str(write_toml(
        f'model = "{TINY_MODEL}"\noutput_dir = "{tmp_path / "run"}"\nmax_steps = 3\nseq_len = 64\nmax_async_level = 1\n'
        f'[inference]\nport = {free_port()}\ndtype = "float32"\n{extra}'
        "[orchestrator.scheduling]\nprompts_per_step = 4\ngroup_size = 4\n"
        "[orchestrator.sampling]\nmax_tokens = 10\ntop_p = 0.8\nrecord_kept_sets = true\n"
        f"{orchestrator}[trainer]\ntorch_threads = 1\n"))


def test_record_kept_sets_whose_sets_may_exceed_max_logprobs_is_refused_at_start_up(write_toml, tmp_path):
    """top_p alone over the 30-character vocabulary: a set may hold all 30, past the default 20."""
    import subprocess

    from conftest import ROOT, rl_command

    result = subprocess.run(rl_command("run", "@", reverse_run(write_toml, tmp_path, "")), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "record_kept_sets" in line]
    assert len(lines) == 1 and "a kept set may hold 30 tokens" in lines[0] and "inference.max_logprobs 20" in lines[0]
    assert not (tmp_path / "run" / "logs" / "inference.log").exists()  # no engine started


# The run also evaluates, as `rl run` does beside training: sampled (pass@k with k = samples = 2)
# on a dataset and on an environment (a multi-turn text game the char-level model can play).
EVALUATION = """[orchestrator.eval]
samples = 2
temperature = 1.0
rows = 4
[[orchestrator.eval.datasets]]
name = "heldout"
function = "tasks.reverse:dataset"
reward = "tasks.reverse:reward"
seed = 7
[[orchestrator.eval.environments]]
name = "letters"
class = "tasks.guess_letter:GuessLetter"
"""


@pytest.fixture(scope="module")
def kept_set_run(tmp_path_factory):
    """One `rl run` (three programs, max_async_level 1, top_p 0.8, kept sets recorded, evaluation
    beside training) shared by the tests below: its metrics.jsonl records."""
    import json
    import subprocess

    from conftest import ROOT, rl_command

    tmp_path = tmp_path_factory.mktemp("kept_set_run")

    def write_toml(text: str):
        (tmp_path / "cfg.toml").write_text(text)
        return tmp_path / "cfg.toml"

    result = subprocess.run(rl_command("run", "@", reverse_run(write_toml, tmp_path, "max_logprobs = 30\n", EVALUATION)),
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_recording_kept_sets_trains_on_the_samplers_own_sets(kept_set_run):
    """Every truncated loss token the trainer scored was renormalised over the set the engine
    recorded (replayed 1.0), and none of the sampled tokens was missing from its set (misses 0):
    orchestrator, batch and trainer carry the sets to the right positions."""
    steps = [r for r in kept_set_run if r.get("program") == "trainer" and "sampling_mask_replayed_frac" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["truncated_frac"] > 0 and r["sampling_mask_replayed_frac"] == 1.0 and r["sampling_mask_miss_frac"] == 0.0, r


@pytest.mark.slow
def test_a_run_evaluates_its_datasets_and_environments_with_pass_at_k(kept_set_run):
    """`rl run`'s own evaluation (program "eval" in metrics.jsonl): the starting weights and the
    last version, each dataset and environment on its 4 rows with 2 samples a row. With n = k = 2,
    pass@2 of a row is 1 if either sample was right, else 0, and pass@1 is the mean over the 8
    samples (the accuracy): so rows * pass@2 and rows * 2 * pass@1 are whole numbers, and
    pass@1 <= pass@2 <= min(1, 2 * pass@1)."""
    evals = [r for r in kept_set_run if r.get("program") == "eval"]
    assert [r["version"] for r in evals] == [0, 3], evals
    for record in evals:
        for name in ("heldout", "letters"):
            rows, p1, p2 = (record[f"eval/{name}/{k}"] for k in ("rows", "pass@1", "pass@2"))
            assert rows == 4 and record[f"eval/{name}/accuracy"] == p1, record
            assert (rows * p2).is_integer() and (rows * 2 * p1).is_integer(), record
            assert p1 <= p2 <= min(1.0, 2 * p1), record
        assert record["eval/letters/failed"] == 0, record  # every episode played to its end
