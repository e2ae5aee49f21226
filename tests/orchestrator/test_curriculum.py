"""Curriculum by pass rate (orchestrator/prompts/curriculum.py): which drawn rows are generated follows
the record of their pass rates, easy and hard rows come back at the revisit rate, the record
survives a checkpoint exactly, and a real run records, skips and reports."""

from __future__ import annotations

import itertools
import json
import subprocess

import pytest

from conftest import ROOT, free_port, rl_command
from orchestrator.prompts.curriculum import Curriculum, row_key
from orchestrator.prompts.queue import Prompt, PromptQueue, decode_state, encode_state
from rl.config.rollout_tables import CurriculumConfig

ROWS = [{"prompt": f"{w}=", "answer": w[::-1]} for w in ("abc", "hello", "xyz", "reverse")]


def stream(n: int):
    """Rows 0..3 round and round, as (dataset, draw) pairs."""
    return ((("", i % len(ROWS)) for i in range(n)))


def fetch(source: str, draw: int) -> tuple[dict, str]:
    return ROWS[draw], f"row {draw}"


def test_rows_outside_the_band_are_drawn_again_only_at_the_revisit_rate():
    cur = Curriculum(CurriculumConfig(enabled=True, band=(0.0, 1.0), revisit_easy=0.2, revisit_hard=0.5,
                                      hard_after=1), seed=0)
    queue = PromptQueue(stream(10_000), fetch, admit=cur.admit)
    first = [queue.take() for _ in range(4)]  # never seen: all admitted
    assert [p.row for p in first] == ROWS
    # abc: every rollout passes (easy); hello: none (hard); xyz, reverse: some (informative).
    for p, rewards in zip(first, ([1.0] * 4, [0.0] * 4, [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0])):
        cur.scored(p, rewards)
    taken = [queue.take().row["prompt"] for _ in range(2000)]
    counts = {r["prompt"]: taken.count(r["prompt"]) for r in ROWS}
    draws = queue.cursor - 4  # drawn after the first four: each row a quarter of them
    assert counts["xyz="] + counts["reverse="] + counts["abc="] + counts["hello="] == 2000
    assert abs(counts["xyz="] - draws / 4) <= 1 and abs(counts["reverse="] - draws / 4) <= 1
    # Easy and hard ones: admitted with probability 0.2 and 0.5 each time they come round, a
    # binomial over draws/4 trials: within 5 standard deviations of its mean.
    trials = draws / 4
    for name, chance in (("abc=", 0.2), ("hello=", 0.5)):
        assert abs(counts[name] - chance * trials) <= 5 * (trials * chance * (1 - chance)) ** 0.5, counts
    report = cur.report()
    assert report["curriculum/skipped"] == draws - 2000
    assert report["curriculum/rows_recorded"] == 4 and report["curriculum/rows_easy_frac"] == 0.25
    assert cur.report()["curriculum/skipped"] == 0  # per step: counted afresh


def test_a_row_counts_as_hard_only_after_hard_after_failed_groups_and_never_once_passed():
    cfg = CurriculumConfig(enabled=True, hard_after=3, revisit_hard=0.01, revisit_easy=0.01)
    cur = Curriculum(cfg, seed=0)
    never, once = Prompt(0, ROWS[1]), Prompt(1, ROWS[2])

    def admitted(p: Prompt) -> bool:
        # Over 200 draws (at index 0 the draw's own number decides: 0.01).
        return all(cur.admit(Prompt(i, p.row)) for i in range(200))

    seen = {"never": [], "once": []}
    for _ in range(4):
        cur.scored(never, [0.0] * 8)
        seen["never"].append(admitted(never))
    for rewards in ([0.0] * 8, [1.0] + [0.0] * 7, [0.0] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 8):
        cur.scored(once, rewards)
        seen["once"].append(admitted(once))
    # Never passed: admitted while its failed groups are fewer than 3, hard from the third on. Passed
    # once: four failed groups after that pass and it is still admitted (within reach).
    assert seen == {"never": [True, True, False, False], "once": [True] * 6}
    state = cur.state()
    assert state[row_key(never)] == [0.0, 4, 0] and state[row_key(once)] == [0.0, 4, 1]
    # The record, checkpointed and resumed, decides alike; older records ([rate, failures], or the
    # rate alone) read as one failure at the band's low and "passed" above it.
    resumed = Curriculum(cfg, seed=0, record=state)
    assert (resumed.failures[row_key(never)], resumed.passed[row_key(once)]) == (4, True)
    old = Curriculum(cfg, seed=0, record={row_key(never): [0.0, 3], row_key(once): 0.5})
    assert (old.failures[row_key(never)], old.passed[row_key(never)]) == (3, False)
    assert (old.failures[row_key(once)], old.passed[row_key(once)]) == (0, True)


def test_a_band_and_a_pass_threshold_classify_pass_rates():
    cur = Curriculum(CurriculumConfig(enabled=True, band=(0.25, 0.75), pass_threshold=0.5), seed=0)
    p = Prompt(0, ROWS[0])
    cur.scored(p, [0.6, 0.4, 0.4, 0.4])  # one in four at >= 0.5: at the band's low edge, hard
    assert cur.rates[row_key(p)] == 0.25 and cur.category(0.25) == "hard"
    assert [cur.category(r) for r in (0.3, 0.5, 0.75, 1.0)] == ["informative", "informative", "easy", "easy"]
    report = cur.report()
    assert report["curriculum/groups_hard_frac"] == 1.0 and report["curriculum/pass_rate_mean"] == 0.25


def test_the_record_is_bounded_least_recently_scored_first():
    cur = Curriculum(CurriculumConfig(enabled=True, max_rows=2), seed=0)
    prompts = [Prompt(i, row) for i, row in enumerate(ROWS[:3])]
    for p in prompts:
        cur.scored(p, [1.0, 0.0])
    cur.scored(prompts[1], [1.0, 1.0])  # scored again: most recent
    assert list(cur.rates) == [row_key(prompts[2]), row_key(prompts[1])]


def test_a_resumed_queue_makes_the_same_decisions_from_the_checkpointed_record():
    """The record goes through the checkpoint's state.json unchanged, and a queue resumed at the
    cursor with it takes exactly the prompts the uninterrupted one takes."""
    cfg = CurriculumConfig(enabled=True, revisit_easy=0.3, revisit_hard=0.3)
    cur = Curriculum(cfg, seed=7)
    queue = PromptQueue(stream(10_000), fetch, admit=cur.admit)
    for p in [queue.take() for _ in range(4)]:
        cur.scored(p, [1.0] * 4 if p.row is ROWS[0] else [0.0, 1.0, 0.0, 0.0])
    _, cursor, _, record = decode_state(encode_state(3, queue.cursor, [], cur.state()))
    assert record == cur.state() and list(record) == list(cur.state())
    resumed_cur = Curriculum(cfg, seed=7, record=record)
    resumed = PromptQueue(stream(10_000), fetch, cursor=cursor, admit=resumed_cur.admit)
    assert [p.index for p in itertools.islice(iter(queue.take, None), 200)] == \
        [p.index for p in itertools.islice(iter(resumed.take, None), 200)]


@pytest.mark.slow
def test_a_run_records_pass_rates_skips_rows_and_checkpoints_the_record(write_toml, tmp_path):
    """rl run on the demo's task and model (exact-match rewards), 32 rows and 16 steps of 4
    prompts x 8: rows come round every 8 steps or so, the run skips some (hard_after 1: one failed
    group judges a row, so 16 steps are enough), reports per step, and its last checkpoint holds
    the record."""
    from rl.rundir import RunDir

    run = RunDir(tmp_path / "run")
    cfg = write_toml(
        f'model = "{ROOT / "models" / "tiny-chat"}"\noutput_dir = "{run.root}"\nmax_steps = 16\nseq_len = 64\n'
        f'max_async_level = 1\n[inference]\nport = {free_port()}\ndtype = "float32"\n'
        "[orchestrator.scheduling]\nprompts_per_step = 4\ngroup_size = 8\nfilter_zero_variance = true\n"
        "[orchestrator.sampling]\nmax_tokens = 10\ntemperature = 0.7\n[orchestrator.curriculum]\nenabled = true\nhard_after = 1\n"
        '[[orchestrator.datasets]]\nreasoning_gym = "spell_backward"\nsize = 32\n'
        "task_config = { min_word_len = 3, max_word_len = 7 }\nreward_weights = { score = 0.0, correct = 1.0 }\n"
        "[trainer]\ntorch_threads = 1\n[trainer.optim]\nlr = 1e-4\n")  # the demo's: 3e-4 wrecks this model
    result = subprocess.run(rl_command("run", "@", str(cfg)), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    orch = [r for r in records if r.get("program") == "orchestrator" and "curriculum/skipped" in r]
    assert [r["step"] for r in orch] == list(range(1, 17))
    assert sum(r["curriculum/skipped"] for r in orch) > 0  # rows came round, and some were out of the band
    last = run.checkpoint_steps("orchestrator")[-1]
    state = json.loads((run.checkpoint_dir(last) / "orchestrator" / "state.json").read_text())
    assert 0 < len(state["curriculum"]) <= 32
    assert all(0.0 <= rate <= 1.0 and failures >= 0 and passed in (0, 1)
               for rate, failures, passed in state["curriculum"].values())
