"""Start-up check: every dataset's prompts, and an environment's first prompts, leave room for a
completion. Once a run spun for ten minutes: a tool environment's system prompt, tool schemas and
question took more than seq_len, so the orchestrator skipped every row it drew (a warning each,
~250,000 lines) while the trainer waited for batch 1. Here the first rows of each dataset (and
of the environment) are rendered and tokenized as the orchestrator will render them, and the run
is refused, naming the longest prompt, when it leaves less than max_tokens within seq_len.

How a row becomes prompt text lives here, not in the orchestrator, because both must measure the
same text: orchestrator/sources.py (Renderer) and orchestrator/tool_episode.py call
`dataset_prompt` and `opening_messages` (rl may not import the orchestrator).

Measured with the model's tokenizer.json through the Rust `tokenizers` library (no torch, as in
orchestrator/tokenizer.py); a model without one is not measured here (the orchestrator would
load transformers for it, which imports torch).

The bound is the one the run needs, seq_len - max_tokens: the orchestrator would still generate
for a prompt that leaves fewer tokens (shorter completions, cut at seq_len), but a config whose
sampled prompts do not leave max_tokens asks for completions the run cannot give.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2

from rl.callables import load_callable
from rl.chat import ChatTemplate, row_messages
from rl.config import ConfigError, RunConfig
from rl.dataset_config import Dataset
from rl.tables import load_table, row_problem
from rl.tools import load_tools

SAMPLE_ROWS = 64  # rows measured per dataset: enough to see a template that never fits, cheap to render


def dataset_prompt(template: ChatTemplate | None, ds: Dataset, row: dict) -> tuple[str, list[dict] | None]:
    """A usable row's prompt text and its chat messages. Chat: the row's messages (or its prompt
    as one user message), the system prompt first, through the template with the generation
    prompt; the template writes the special tokens. Raw (no template, messages None): the prompt
    text as is, to which the tokenizer adds its own. Raises TemplateError from the template."""
    if template is None:
        return row[ds.spec.prompt_key], None
    messages = row_messages(row, ds.spec.prompt_key, ds.spec.messages_key, ds.system_prompt)
    return template.render(messages), messages


def opening_messages(env, row: dict) -> list[dict]:
    """A tool environment's first messages: its own messages(row) if it has one, else the row's
    prompt or messages after its system_prompt."""
    if hasattr(env, "messages"):
        return env.messages(row)
    return row_messages(row, "prompt", "messages", getattr(env, "system_prompt", "") or "")


@dataclass
class Longest:
    """The longest prompt measured so far, and how many exceeded the budget."""
    tokens: int = 0
    where: str = ""
    over: int = 0
    measured: int = 0

    def add(self, tokens: int, where: str, budget: int) -> None:
        self.measured += 1
        self.over += tokens > budget
        if tokens > self.tokens:
            self.tokens, self.where = tokens, where


def _tokenizer(model: Path):
    path = model / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _count(tokenizer, text: str, special: bool) -> int:
    return len(tokenizer.encode(text, add_special_tokens=special).ids)


def _sample(cfg: RunConfig, ds: Dataset) -> Iterator[tuple[dict, str]]:
    """(row, where) for a dataset's first SAMPLE_ROWS rows (a table's in file order, a function's in
    its own)."""
    seed = cfg.seed if ds.spec.seed is None else ds.spec.seed
    if ds.spec.function:
        rows = load_callable(ds.spec.function, f"dataset {ds.name}: function")(seed)
        for i, row in enumerate(itertools.islice(rows, SAMPLE_ROWS)):
            yield row, f"{ds.spec.function} row {i}"
        return
    table = load_table(ds.spec, seed)
    for i in range(min(SAMPLE_ROWS, len(table))):
        yield table[i], f"{table.where} row {table.source_row(i)}"


def _measure_dataset(cfg: RunConfig, ds: Dataset, template: ChatTemplate | None, tokenizer) -> Longest:
    budget, longest = cfg.seq_len - ds.sampling.max_tokens, Longest()
    for row, where in _sample(cfg, ds):
        if row_problem(row, ds.spec) is not None or (template is None and row.get(ds.spec.messages_key) is not None):
            continue  # a row that cannot make a prompt at all: skipped and counted when drawn
        try:
            text, messages = dataset_prompt(template, ds, row)
        except jinja2.TemplateError:
            continue  # the template fails on this row alone: skipped when drawn (orchestrator_data checks row 0)
        longest.add(_count(tokenizer, text, special=messages is None), where, budget)
    return longest


def _refusal(cfg: RunConfig, what: str, longest: Longest, max_tokens: int, keys: str) -> str:
    budget = cfg.seq_len - max_tokens
    return (f"{what}: {longest.over} of the first {longest.measured} prompts leave less than max_tokens "
            f"({max_tokens}) within seq_len ({cfg.seq_len}); the longest is {longest.tokens} tokens "
            f"({longest.where}), over the {budget} a prompt may take: raise seq_len, lower {keys}")


def datasets_fit(cfg: RunConfig) -> None:
    """Every training and eval dataset's first rows leave max_tokens within seq_len."""
    o = cfg.orchestrator
    if o.environment:
        return  # measured where the environment is built (environment_fits)
    tokenizer = _tokenizer(cfg.model)
    if tokenizer is None:
        return
    template = ChatTemplate.configured(o, cfg.model)
    for ds, kind in [(ds, "") for ds in o.resolved_datasets()] + \
            [(ds, "eval ") for ds in o.resolved_datasets(evaluation=True)]:
        what = f"{kind}dataset {ds.name}"
        try:
            longest = _measure_dataset(cfg, ds, template, tokenizer)
        except ConfigError:
            raise
        except Exception as e:  # a function dataset whose later rows raise
            first = (str(e).strip().splitlines() or [""])[0]
            raise ConfigError(f"{what}: measuring its first prompts failed: {type(e).__name__}: {first}") from None
        if longest.over:
            keys = "orchestrator.max_tokens" if ds.spec.max_tokens is None else "the dataset's max_tokens"
            if template is not None and ds.system_prompt:
                prompt_key = "orchestrator.system_prompt" if ds.spec.system_prompt is None else "its system_prompt"
                keys += f" or shorten {prompt_key}"
            raise ConfigError(_refusal(cfg, what, longest, ds.sampling.max_tokens, keys))


def environment_fits(cfg: RunConfig, env) -> None:
    """An environment's first rows' opening prompts (a tool environment's system prompt, tool
    schemas and question through the chat template, as orchestrator/tool_episode.py renders them;
    a text environment's episode start) leave orchestrator.max_tokens within seq_len. `env`: the
    built environment (rl/preflight.py builds it once, and has checked a tool environment's
    tools and template)."""
    o = cfg.orchestrator
    tokenizer = _tokenizer(cfg.model)
    if tokenizer is None:
        return
    key = f"orchestrator.environment = {o.environment!r}"
    opening = _opening(cfg, env, tokenizer)
    budget, longest = cfg.seq_len - o.max_tokens, Longest()
    try:
        for i, row in enumerate(itertools.islice(env.dataset(cfg.seed), SAMPLE_ROWS)):
            tokens = opening(row)
            if tokens is not None:
                longest.add(tokens, f"row {i} of its dataset(seed={cfg.seed})", budget)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"{key}: measuring its first prompts failed: {type(e).__name__}: {first}") from None
    if longest.over:
        keys = "orchestrator.max_tokens"
        if hasattr(env, "tools"):
            keys += " or shorten the environment's system prompt, tool schemas (docstrings) or questions"
        raise ConfigError(_refusal(cfg, key, longest, o.max_tokens, keys))


def _opening(cfg: RunConfig, env, tokenizer) -> Callable[[dict], int | None]:
    """row -> tokens of an episode's first prompt, or None where that episode fails on its own."""
    if not hasattr(env, "tools"):
        return lambda row: _count(tokenizer, env.episode(row).start(), special=True)
    template = ChatTemplate.configured(cfg.orchestrator, cfg.model)
    schemas = [t.schema for t in load_tools(env.tools, "tools").values()]

    def tool_opening(row: dict) -> int | None:
        try:
            text = template.render(opening_messages(env, row), True, schemas)
        except jinja2.TemplateError:
            return None  # that episode fails naming the template (orchestrator/rollouts.py)
        return _count(tokenizer, text, special=False)

    return tool_opening
