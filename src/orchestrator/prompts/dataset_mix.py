"""Datasets as the orchestrator uses them: where each prompt comes from (the seeded mix of the
configured datasets), how a row becomes prompt ids (the chat template, or raw text), and what
the generation request asks for (the dataset's sampling settings, stop tokens).

The mix is a pure function of the seed: each draw picks a dataset by weight, then that dataset's
next row (a table's rows are reshuffled for every pass, a function's come in its own order). A
draw of a table row is just a position, so a resumed orchestrator replays `cursor` draws cheaply
and lands exactly where the run was (orchestrator/prompts/queue.py).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator
from pathlib import Path

import jinja2

from orchestrator.callables import load_callable
from orchestrator.prompts.chat import ChatTemplate, read_json, token_text
from orchestrator.prompts.fit import dataset_prompt, draw_order
from orchestrator.prompts.tables import Table, load_table, row_problem
from rl.config import OrchestratorConfig
from rl.config.datasets import Dataset

log = logging.getLogger("orchestrator")


class RowError(Exception):
    """A row that can never make a rollout (no prompt, too long): dropped, not requeued. `fix`:
    what would make such rows usable, for the line that stops a run skipping every row
    (orchestrator/streaks.py)."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


class Source:
    """One configured dataset: its rows and how they become requests."""

    def __init__(self, ds: Dataset, seed: int):
        self.ds, self.name, self.spec = ds, ds.name, ds.spec
        self.seed = seed if self.spec.seed is None else self.spec.seed
        self.reward = None  # its Reward (orchestrator/rewards/reward.py), set after construction (orchestrator/rewards/registry.py: configured_sources)
        self.table: Table | None = None if self.spec.function else load_table(self.spec, self.seed)

    def draws(self) -> Iterator[int | dict]:
        """This dataset's order: positions in its table, or the rows of its function."""
        seed = self.seed
        if self.table is None:
            rows = load_callable(self.spec.function, f"dataset {self.name}: function")(seed)
            yield from rows
            return
        for p in itertools.count() if self.spec.passes is None else range(self.spec.passes):
            yield from draw_order(len(self.table), self.ds, seed, p)  # the order the start-up check samples

    @property
    def reward_weights(self) -> dict[str, float]:
        """The reward function's own component weights, with the dataset's over them."""
        return {**(self.reward.weights if self.reward else {}), **self.ds.reward_weights}

    def fetch(self, draw: int | dict) -> tuple[dict, str]:
        """(row, where it came from: for messages about it). Rewards read the reference answer
        as row["answer"] whatever the dataset's answer_key."""
        if self.table is None:
            row, where = draw, f"dataset {self.name}"
        else:
            row, where = self.table[draw], f"dataset {self.name} ({self.table.where} row {self.table.source_row(draw)})"
        key = self.spec.answer_key
        if key != "answer" and isinstance(row, dict) and key in row:
            row = {**row, "answer": row[key]}
        return row, where


def mix(sources: list[Source], seed: int) -> Iterator[tuple[str, int | dict]]:
    """The run's stream of (dataset name, draw). A used-up dataset leaves the mix."""
    live = list(sources)
    streams = {s.name: s.draws() for s in live}
    rng = random.Random(seed)
    while live:
        # One dataset draws no random numbers, so a run from before datasets could be mixed
        # resumes on the very same stream.
        s = live[0] if len(live) == 1 else rng.choices(live, weights=[x.spec.weight for x in live])[0]
        try:
            yield s.name, next(streams[s.name])
        except StopIteration:
            live.remove(s)


class Renderer:
    """A row -> (the prompt text a reward sees, prompt ids). Chat: the row's messages (or its
    prompt as one user message), a system message first if configured, through the chat
    template with the generation prompt. Raw: the prompt text as is."""

    def __init__(self, o: OrchestratorConfig, model: Path, tokenizer, encode):
        self.encode = encode
        self.template = ChatTemplate.configured(o, model)
        self.stop_token_ids = stop_token_ids(model, tokenizer, self.template)

    def render(self, ds: Dataset, row: dict, where: str) -> tuple[str, list[int]]:
        problem = row_problem(row, ds.spec)
        if problem is not None:
            raise RowError(f"{where} {problem}", f"set dataset {ds.name}'s prompt_key / messages_key to the fields "
                           "that hold the prompt")
        messages = row.get(ds.spec.messages_key)
        if self.template is None:
            if messages is not None:
                raise RowError(f"{where} holds chat messages but the model has no chat template",
                               "set orchestrator.prompts.chat_template, or use a chat model")
            text, _ = dataset_prompt(None, ds, row)
            return text, self.encode(text)
        try:  # the text the start-up check measured (orchestrator/prompts/fit.py)
            text, messages = dataset_prompt(self.template, ds, row)
        except jinja2.TemplateError as e:
            raise RowError(f"{where}: the chat template ({self.template.origin}) failed: {e}",
                           "fix the template (orchestrator.prompts.chat_template) or the row") from None
        # The reward sees what the user asked (the last user message), not the markup.
        asked = next((m["content"] for m in reversed(messages) if m["role"] == "user"), text)
        return asked, self.encode(text, add_special_tokens=False)


def stop_token_ids(model: Path, tokenizer, template: ChatTemplate | None) -> list[int]:
    """Where a completion ends: the tokenizer's eos, generation_config.json's eos ids (several in
    chat models), and the template's end-of-turn token."""
    ids: list[int] = []
    eos = token_text(read_json(Path(model) / "tokenizer_config.json").get("eos_token"))
    if eos is not None and tokenizer is not None and tokenizer.token_to_id(eos) is not None:
        ids.append(tokenizer.token_to_id(eos))
    generation = read_json(Path(model) / "generation_config.json").get("eos_token_id")
    ids += generation if isinstance(generation, list) else [generation] if isinstance(generation, int) else []
    if template is not None and tokenizer is not None:
        ids += template.end_of_turn(tokenizer)
    return sorted(set(ids))
