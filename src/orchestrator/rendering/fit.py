"""Start-up check: the prompts a run will draw first leave room for a completion. Once a run spun
for ten minutes: a tool environment's system prompt, tool schemas and question took more than
seq_len, so the orchestrator skipped every row it drew (a warning each, ~250,000 lines) while the
trainer waited for batch 1. Here the first rows the run draws from each dataset (and from the
environment) are rendered and tokenized as the orchestrator will render them (rl/preflight.py
runs this on the rows it checks anyway: one table load, one pass).

The rule follows what the orchestrator does with a long prompt: it still generates, with
max_tokens cut to what seq_len leaves (orchestrator/rollout/groups.py `room`), and skips the row only
when nothing is left. So a few long rows among short ones are fine: one warning at start-up
(how many of the sample, the longest, the keys). A config is refused (ConfigError, exit 2) when
at least half of the sample leaves less than max_tokens: the run would mostly truncate or skip.
That includes the case where no sampled prompt leaves any room at all.

How a row becomes prompt text (`dataset_prompt`) lives here, and the check samples a table's rows
in the order the run draws them (`draw_order`, the prompts station's): the check and the run
(orchestrator/rendering/renderer.py: Renderer; orchestrator/prompts/dataset_mix.py: Source.draws)
must use the same. An environment's opening prompt is measured by its kind (`start_up`,
orchestrator/rollout/text_environment.py and tool_environment.py).

Measured with the model's tokenizer.json through the Rust `tokenizers` library (no torch, as in
orchestrator/rendering/tokenizer.py); a model without one is not measured here (the orchestrator would
load transformers for it, which imports torch).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jinja2

from orchestrator.callables import load_callable
from orchestrator.prompts import draw_order, load_table, row_problem
from orchestrator.rendering.chat import ChatTemplate, row_messages
from orchestrator.rendering.images import expanded_text, has_images, image_support
from rl.config import ConfigError, RunConfig
from rl.config.datasets import Dataset

Opening = Callable[[dict], "int | None"]
"""row -> tokens of an episode's first prompt, or None where that episode would fail on its own
(an environment kind's start_up gives it; the fit check measures the rows with it)."""

log = logging.getLogger("rl")

SAMPLE_ROWS = 64  # rows measured per dataset: enough to see a template that never fits, cheap to render


def error_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first line (a traceback-like message
    from a user's code must not break the one-line refusal)."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def dataset_prompt(template: ChatTemplate | None, ds: Dataset, row: dict) -> tuple[str, list[dict] | None]:
    """A usable row's prompt text and its chat messages. Chat: the row's messages (or its prompt
    as one user message), the system prompt first, through the template with the generation
    prompt; the template writes the special tokens. Raw (no template, messages None): the prompt
    text as is, to which the tokenizer adds its own. Raises TemplateError from the template."""
    if template is None:
        return row[ds.spec.prompt_key], None
    messages = row_messages(row, ds.spec.prompt_key, ds.spec.messages_key, ds.system_prompt)
    return template.render(messages), messages


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


def tokenizer_of(model: Path):
    path = model / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _count(tokenizer, text: str, special: bool) -> int:
    return len(tokenizer.encode(text, add_special_tokens=special).ids)


def sample(cfg: RunConfig, ds: Dataset, label: str) -> list[tuple[dict, str]]:
    """(row, where) for the first SAMPLE_ROWS rows the run draws from a dataset: a function's in its
    own order, a table's in the run's order (shuffled unless shuffle = false; loaded once).
    `label`: how a function dataset's rows are named (the key that names the function)."""
    seed = cfg.seed if ds.spec.seed is None else ds.spec.seed
    if ds.spec.function:
        rows = load_callable(ds.spec.function, label)(seed)
        return [(row, f"{label} row {i}") for i, row in enumerate(itertools.islice(rows, SAMPLE_ROWS))]
    table = load_table(ds.spec, seed)
    order = draw_order(len(table), ds, seed, 0)
    return [(table[i], f"{table.where} row {table.source_row(i)}") for i in order[:SAMPLE_ROWS]]


def measure(cfg: RunConfig, ds: Dataset, rows: list[tuple[dict, str]], template: ChatTemplate | None,
            tokenizer) -> Longest:
    """The sampled rows' prompt lengths. The first row's template failure raises (a template that
    fails on the first row drawn is refused by rl/preflight.py); a later row's is that row's
    alone, skipped when drawn. Without a tokenizer only the first row is rendered."""
    budget, longest = cfg.seq_len - ds.sampling.max_tokens, Longest()
    for i, (row, where) in enumerate(rows if tokenizer is not None else rows[:1]):
        if row_problem(row, ds.spec) is not None or (template is None and row.get(ds.spec.messages_key) is not None):
            continue  # a row that cannot make a prompt at all: skipped and counted when drawn
        try:
            text, messages = dataset_prompt(template, ds, row)
            text, where = _expanded(cfg, template, text, messages, where)
        except jinja2.TemplateError:
            if i == 0:
                raise
            continue
        if tokenizer is not None:
            longest.add(_count(tokenizer, text, special=messages is None), where, budget)
    return longest


def _expanded(cfg: RunConfig, template: ChatTemplate | None, text: str, messages: list[dict] | None,
              where: str) -> tuple[str, str]:
    """An image row's prompt as the model reads it, each placeholder expanded as the run's
    renderer expands it (orchestrator/rendering/images.py expanded_text): one placeholder token
    per image let rows through that left no room once expanded (tiny-vlm: 19 tokens for 1).
    Other rows, and image rows for a text-only model (refused before this: images_at_start_up),
    as they are."""
    if template is None or messages is None or not has_images(messages):
        return text, where
    support = image_support(cfg.model)
    if support is None:
        return text, where
    return expanded_text(template, support, messages)[1], f"{where}, its images expanded"


def judge(cfg: RunConfig, what: str, longest: Longest, max_tokens: int, keys: str) -> None:
    """Refuse (ConfigError) when at least half the sample leaves less than max_tokens; otherwise
    warn once if any does: those rows get shorter completions (or are skipped if nothing is left)."""
    if not longest.over:
        return
    said = (f"{what}: {longest.over} of the first {longest.measured} prompts drawn leave less than max_tokens "
            f"({max_tokens}) within seq_len ({cfg.seq_len}); the longest is {longest.tokens} tokens "
            f"({longest.where}), over the {cfg.seq_len - max_tokens} a prompt may take")
    if 2 * longest.over >= longest.measured:
        raise ConfigError(f"{said}: raise seq_len, lower {keys}")
    log.warning("%s: those get fewer tokens to generate (none left: skipped); to give them max_tokens, "
                "raise seq_len, lower %s", said, keys)


def dataset_fits(cfg: RunConfig, what: str, ds: Dataset, longest: Longest, template: ChatTemplate | None) -> None:
    """Judge a dataset's measured sample (`what`: how messages name it)."""
    keys = "orchestrator.sampling.max_tokens" if ds.spec.sampling.max_tokens is None else "the dataset's sampling.max_tokens"
    if template is not None and ds.system_prompt:
        keys += " or shorten " + ("orchestrator.prompts.system_prompt" if ds.spec.prompts.system_prompt is None else "its prompts.system_prompt")
    judge(cfg, what, longest, ds.sampling.max_tokens, keys)


def environment_fits(cfg: RunConfig, env, opening: Callable[[object], Opening], keys: str) -> None:
    """An environment's first rows' opening prompts (a tool environment's system prompt, tool
    schemas and question through the chat template, as orchestrator/rollout/tool_episode.py renders them;
    a text environment's episode start) leave orchestrator.sampling.max_tokens within seq_len. `env`: the
    built environment; `opening`, from its kind's start-up checks (EnvironmentKind.start_up):
    tokenizer -> row -> tokens of the opening prompt; `keys`: what the user may change."""
    o = cfg.orchestrator
    tokenizer = tokenizer_of(cfg.model)
    if tokenizer is None:
        return
    key = f"orchestrator.environment.class = {o.environment.class_!r}"
    measure = opening(tokenizer)
    budget, longest = cfg.seq_len - o.sampling.max_tokens, Longest()
    try:
        for i, row in enumerate(itertools.islice(env.dataset(cfg.seed), SAMPLE_ROWS)):
            tokens = measure(row)
            if tokens is not None:
                longest.add(tokens, f"row {i} of its dataset(seed={cfg.seed})", budget)
    except Exception as e:  # its dataset raised: the run could draw no row
        raise ConfigError(f"{key}: measuring its first prompts failed: {error_line(e)}") from None
    judge(cfg, key, longest, o.sampling.max_tokens, keys)
