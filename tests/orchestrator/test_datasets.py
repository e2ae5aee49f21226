"""Datasets from files and tasks (orchestrator/prompts/tables.py, orchestrator/prompts/dataset_mix.py): jsonl, parquet and HF
`datasets` rows with mapped fields; the seeded mix by weight, shuffled per pass; an exact resume
from the checkpointed cursor; bad rows skipped and counted, bad files named; the reasoning-gym
and math-verify scorers; reward components; the three ways to treat completions cut at
max_tokens."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging

import aiohttp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import TINY_MODEL
from fake_inference import FakeServer, with_server
from orchestrator.prompts.dataset_mix import Source, mix
from orchestrator.prompts.queue import PromptQueue, decode_state, encode_state
from orchestrator.prompts.tables import load_table
from orchestrator.rendering.tokenizer import load_tokenizer
from orchestrator.rewards.registry import make_reward
from orchestrator.rewards.reward import combine
from orchestrator.rollout.groups import Rollouts
from rl.config import ConfigError, RunConfig
from rl.inference_api import connector
from tasks import gym_tasks
from tasks.math_answer import reward as math_reward


def write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def run_config(datasets, **orchestrator) -> RunConfig:
    return RunConfig.model_validate({"model": str(TINY_MODEL), "seq_len": 64,
                                     "orchestrator": {"datasets": datasets, **orchestrator}})


def sources(cfg: RunConfig) -> list[Source]:
    return [Source(d, cfg.seed) for d in cfg.orchestrator.resolved_datasets()]


def queue(cfg: RunConfig, cursor: int = 0, pending=()) -> PromptQueue:
    by_name = {s.name: s for s in sources(cfg)}
    return PromptQueue(mix(list(by_name.values()), cfg.seed), lambda n, d: by_name[n].fetch(d), cursor, pending)


def test_jsonl_parquet_and_hf_datasets_give_the_same_rows(tmp_path):
    rows = [{"question": f"q{i}", "solution": str(i), "level": i % 3} for i in range(20)]
    write_jsonl(tmp_path / "a.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "files").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "files" / "part-0.parquet")
    mapping = {"prompt_key": "question", "answer_key": "solution", "reward": "math_verify", "shuffle": False}
    specs = [{"path": str(tmp_path / "a.jsonl")}, {"path": str(tmp_path / "a.parquet")},
             {"path": str(tmp_path / "saved")}, {"path": str(tmp_path / "dict"), "split": "test"},
             {"path": str(tmp_path / "files")}]
    for spec in specs:
        cfg = run_config([{**spec, **mapping}])
        (source,) = sources(cfg)
        got = [source.fetch(d)[0] for d in itertools.islice(source.draws(), 20)]
        assert got == [{**r, "answer": r["solution"]} for r in rows], spec
    with pytest.raises(ConfigError, match=r"has no split 'train' \(splits: test\); set split"):
        load_table(run_config([{"path": str(tmp_path / "dict"), **mapping}]).orchestrator.datasets[0], 0)


def test_the_mix_follows_the_weights_and_each_pass_covers_every_row(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(7)])
    cfg = run_config([{"path": str(a), "weight": 3.0, "reward": "x:y"}, {"path": str(b), "reward": "x:y"}])
    q = queue(cfg)
    taken = [q.take() for _ in range(4000)]
    counts = collections.Counter(p.source for p in taken)
    assert 0.72 < counts["a"] / 4000 < 0.78  # 3:1; binomial sd is 0.007
    # Each pass over a dataset holds each of its rows once, in a new order.
    a_rows = [p.row["prompt"] for p in taken if p.source == "a"]
    passes = [a_rows[i:i + 10] for i in range(0, 30, 10)]
    assert all(sorted(p) == sorted(f"a{i}" for i in range(10)) for p in passes)
    assert passes[0] != passes[1]
    # The same seed gives the same stream; another seed another.
    again = queue(cfg)
    assert [again.take().row for _ in range(50)] == [p.row for p in taken[:50]]
    other = queue(cfg.model_copy(update={"seed": 1}))
    assert [other.take().row for _ in range(50)] != [p.row for p in taken[:50]]


def test_a_dataset_with_passes_leaves_the_mix_when_used_up(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(3)])
    cfg = run_config([{"path": str(a), "passes": 2, "reward": "x:y"}, {"path": str(b), "passes": 1, "reward": "x:y"}])
    q = queue(cfg)
    taken = [q.take().row["prompt"] for _ in range(9)]
    assert sorted(taken) == sorted([f"a{i}" for i in range(3)] * 2 + [f"b{i}" for i in range(3)])
    with pytest.raises(RuntimeError, match="the datasets ran out after 9 rows"):
        q.take()


def test_resume_from_the_checkpointed_cursor_neither_skips_nor_repeats(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(11)])
    cfg = run_config([{"path": str(a), "reward": "x:y"},
                      {"reasoning_gym": "spell_backward", "size": 13, "weight": 0.5},
                      {"function": "tasks.reverse:dataset", "reward": "x:y"}])
    whole = queue(cfg)
    first = [whole.take() for _ in range(40)]
    pending = [first[3], first[17]]  # drawn but never batched (in flight when the run stopped)
    step, cursor, back, _ = decode_state(encode_state(5, whole.cursor, pending))
    assert (step, cursor, back) == (5, 40, pending)
    resumed = queue(cfg, cursor, back)
    assert [resumed.take() for _ in range(2)] == pending
    rest = [resumed.take() for _ in range(60)]
    assert rest == [whole.take() for _ in range(60)]
    assert {p.source for p in rest} == {"a", "spell_backward", "reverse"}


def test_bad_rows_are_skipped_and_counted_with_their_position(tmp_path, caplog):
    rows = [{"prompt": "ok0"}, {"prompt": None}, {"messages": "not a list"}, {"prompt": "ok3"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows, ["{not json\n"])
    with caplog.at_level(logging.WARNING, "orchestrator"):
        table = load_table(run_config([{"path": str(path), "reward": "x:y"}]).orchestrator.datasets[0], 0)
    assert [table[i]["prompt"] for i in range(len(table))] == ["ok0", "ok3"]
    assert [i for i, _ in table.skipped] == [1, 2, 4]
    assert "3 unusable row(s) skipped (row 1: has neither a 'prompt' string" in caplog.text
    assert "d.jsonl line 5 is not JSON" in caplog.text
    (source,) = sources(run_config([{"path": str(path), "reward": "x:y", "shuffle": False}]))
    assert source.fetch(1)[1] == f"dataset d ({path} row 3)"


@pytest.mark.parametrize("content, spec, message", [
    (None, {}, "no such file or directory"),
    ([{"question": "x"}], {}, "row 0 has neither a 'prompt' string nor a 'messages' list (and so does every "
                              "other row; set prompt_key"),
    ([{"question": "x"}], {"parquet": True}, "has no column 'prompt' or 'messages' (columns: question)"),
    ([], {}, "has no rows"),
])
def test_unusable_files_stop_the_start_naming_file_and_field(tmp_path, content, spec, message):
    path = tmp_path / ("d.parquet" if spec.get("parquet") else "d.jsonl")
    if content is not None and spec.get("parquet"):
        pq.write_table(pa.Table.from_pylist(content), path)
    elif content is not None:
        write_jsonl(path, content)
    with pytest.raises(ConfigError, match=r"dataset d: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        load_table(run_config([{"path": str(path), "reward": "x:y"}]).orchestrator.datasets[0], 0)


def test_reasoning_gym_rows_are_scored_by_their_task():
    cfg = run_config([{"reasoning_gym": "basic_arithmetic", "size": 5,
                       "task_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}])
    (source,) = sources(cfg)
    assert source.ds.reward == "reasoning_gym"  # the task's own scorer by default
    row, _ = source.fetch(0)
    assert row["prompt"].startswith("Calculate ")
    right, wrong = row["answer"], str(int(row["answer"]) + 1)
    assert gym_tasks.reward(row["prompt"], right, row) == {"score": 1.0, "correct": 1.0}
    assert gym_tasks.reward(row["prompt"], wrong, row) == {"score": 0.0, "correct": 0.0}
    assert gym_tasks.reward(row["prompt"], f"Let me think. 1+1 <answer>{right}</answer>", row)["correct"] == 1.0
    # Partial credit stays the reward by default; `correct` is logged beside it.
    spell = sources(run_config([{"reasoning_gym": "spell_backward", "size": 3}]))[0]
    row, _ = spell.fetch(0)
    almost = gym_tasks.reward(row["prompt"], row["answer"][:-1] + "#", row)
    assert 0 < almost["score"] < 1 and almost["correct"] == 0.0
    assert combine(almost, gym_tasks.reward.weights)[0] == almost["score"]
    with pytest.raises(ConfigError, match="reasoning_gym = 'no_such_task'"):
        sources(run_config([{"reasoning_gym": "no_such_task"}]))


def test_math_verify_scores_final_answers_with_components():
    row = {"answer": "\\frac{1}{2}"}
    assert math_reward("", "So the answer is \\boxed{0.5}.", row) == {"correct": 1.0, "boxed": 1.0}
    assert math_reward("", "It is 1/2", row) == {"correct": 1.0, "boxed": 0.0}
    assert math_reward("", "\\boxed{2}", row) == {"correct": 0.0, "boxed": 1.0}
    # The format is logged, not rewarded, unless a dataset weighs it.
    assert combine({"correct": 0.0, "boxed": 1.0}, math_reward.weights) == (0.0, {"correct": 0.0, "boxed": 1.0})
    assert combine({"correct": 1.0, "boxed": 1.0}, {**math_reward.weights, "boxed": 0.1})[0] == pytest.approx(1.1)


def test_a_reward_returning_something_else_fails_that_rollout(caplog):
    async def scenario(fn):
        async with aiohttp.ClientSession(connector=connector()) as session:
            reward = make_reward("tasks.math_answer:reward", 5.0, session)
            reward.fn = fn
            return await reward.score("p", ["a"], {})

    assert asyncio.run(scenario(lambda p, c, r: {"x": 1, "y": 0.5})) == [{"x": 1.0, "y": 0.5}]
    with caplog.at_level(logging.WARNING, "orchestrator"):
        assert asyncio.run(scenario(lambda p, c, r: float("nan"))) == [None]
        assert asyncio.run(scenario(lambda p, c, r: "1.0")) == [None]
    assert "returned '1.0', not a finite number" in caplog.text


def components_reward(prompt, completion, row):
    return {"length": len(completion) / 10, "has_a": float("a" in completion)}


@pytest.mark.parametrize("overlong", ["keep", "mask", "penalty"])
def test_completions_cut_at_max_tokens(overlong):
    """Samples would stop after 2, 5, 11, 30 tokens: with max_tokens 10 the last two are cut."""
    cfg = run_config([{"function": "tasks.reverse:dataset", "reward": "test_datasets:components_reward",
                       "reward_weights": {"has_a": 0.0},
                       "sampling": {"max_tokens": 10, "temperature": 0.7, "top_k": 5}}],
                     scheduling={"group_size": 4}, overlong={"mode": overlong, "buffer": 5, "penalty": 0.5})
    lengths = iter([2, 5, 11, 30])
    server = FakeServer(lengths=lambda: next(lengths))

    async def body(client, session):
        srcs = {s.name: s for s in sources(cfg)}
        rewards = {name: make_reward(s.ds.reward, 5.0, session, key="r") for name, s in srcs.items()}
        rollouts = Rollouts(cfg, load_tokenizer(str(TINY_MODEL)), srcs, None, None, rewards)
        prompt = queue(cfg).take()
        return await rollouts.group(prompt, "g", lambda r: client.generate(r, 10))

    group = asyncio.run(with_server(server, body))
    (request,) = server.requests.values()
    assert group.truncated == 2
    model_tokens = [s.num_model_tokens for s in group.samples]
    assert model_tokens == ([2, 5, 10, 10] if overlong != "mask" else [2, 5, 0, 0])
    # The reward: the weighted components (has_a weighs 0), minus the penalty over the last 5 tokens.
    penalty = [0.0, 0.0, 0.5, 0.5] if overlong == "penalty" else [0.0] * 4
    assert [s.reward for s in group.samples] == pytest.approx([n / 10 - p for n, p in zip([2, 5, 10, 10], penalty)])
    assert all(c["length"] == n / 10 for c, n in zip(group.components, [2, 5, 10, 10]))
    # Every sample says how it was drawn.
    assert all((s.temperature, s.top_k, s.top_p, s.min_p) == (0.7, 5, 1.0, 0.0) for s in group.samples)
    assert request.n == 4


def test_a_runs_rows_come_from_the_prompts_station_whichever_kind_plays_them():
    """orchestrator/prompts/rows.py: the queue draws the datasets' seeded mix, or the environment's
    dataset(seed), from the prompts station; the rollout kind no longer hands rows back up to it.
    A dataset's source carries no reward: the rewards station's are by the dataset's name."""
    from orchestrator.prompts import Rows
    from orchestrator.rewards import configured_rewards
    from tasks.guess_letter import GuessLetter

    cfg = run_config([{"name": "a", "function": "tasks.reverse:dataset", "reward": "tasks.reverse:reward"},
                      {"name": "b", "function": "tasks.count:dataset", "reward": "tasks.count:reward", "weight": 2.0}])
    rows = Rows.for_run(cfg)
    assert rows.env is None and set(rows.sources) == {"a", "b"}
    drawn = [rows.fetch(*d) for d in itertools.islice(rows.draws(cfg.seed), 12)]
    taken = queue(cfg)  # the same stream as the datasets' mix drawn by hand
    assert drawn == [(p.row, p.where) for p in (taken.take() for _ in range(12))]
    assert {d[0] for d in itertools.islice(rows.draws(cfg.seed), 12)} == {"a", "b"}
    assert not hasattr(rows.sources["a"], "reward")
    rewards = configured_rewards(cfg, None)
    assert set(rewards) == {"a", "b"} and rewards["a"].spec == "tasks.reverse:reward"

    env_cfg = RunConfig.model_validate({"model": str(TINY_MODEL), "orchestrator": {
        "environment": {"class": "tasks.guess_letter:GuessLetter"}}})
    rows = Rows.for_run(env_cfg)
    assert isinstance(rows.env, GuessLetter) and rows.sources == {}
    first = list(itertools.islice(rows.draws(env_cfg.seed), 3))
    assert first == [("", r) for r in itertools.islice(GuessLetter().dataset(env_cfg.seed), 3)]
    assert rows.fetch(*first[0]) == (first[0][1], "orchestrator.environment")
