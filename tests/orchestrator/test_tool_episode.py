"""Tool-calling episodes (orchestrator/rollout/tool_episode.py) through the orchestrator's rollout code,
with models/tiny-chat's tokenizer and its tool-calling ChatML template.

Here a scripted server writes the model's turns: these tests need turns no small model writes on
cue (several calls in one turn, every kind of bad call). The real engine runs the same path in
tests/orchestrator/test_tool_episode_vllm.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import pytest

from orchestrator.preflight import orchestrator_code
from orchestrator.rendering.chat import ChatTemplate
from orchestrator.rollout.groups import Rollouts
from rl.config import ConfigError, RunConfig
from scripted_model import CHAT_MODEL, ScriptedModel, TOKENIZER, TOOL_TIMEOUT_S, config


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def hang(seconds: float) -> str:
    """Wait."""
    await asyncio.sleep(seconds)
    return "woke"


def fail() -> str:
    """Always raises."""
    raise ValueError("no")


class Tools:
    tools = [add, hang, fail]
    system_prompt = "Use the tools."

    def dataset(self, seed):
        return ({"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in itertools.count())

    def reward(self, messages, row):
        return float(messages[-1]["role"] == "assistant" and messages[-1]["content"] == row["answer"])


class NoReward:
    tools = [add]

    def dataset(self, seed):
        return iter([])


SCRIPT = [
    # Two calls in one turn, one to a tool that does not exist.
    'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    # Every other way a call goes wrong, in one turn.
    '<tool_call>\n{"name": "add", "arguments": {"a": "x", "b": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>\n'
    '<tool_call>\n{"name": "hang", "arguments": {"seconds": 3600}}\n</tool_call>\n'
    '<tool_call>\n{"name": "fail", "arguments": {}}\n</tool_call>',
    "1",
]
TOOL_REPLIES = [
    ["5", "error: unknown tool 'nope'; the tools are add, hang, fail"],
    ["error: add: argument a: \"x\" is not an integer",
     "error: malformed tool call: not JSON (Expecting ',' delimiter: line 3 column 1 (char 39))",
     f"error: hang: no result within {TOOL_TIMEOUT_S} s",
     "error: fail raised ValueError: no"],
]


def run_group(cfg: RunConfig, model) -> tuple[Rollouts, object]:
    from orchestrator.prompts.queue import Prompt
    from orchestrator.rendering.tokenizer import load_tokenizer

    env = Tools()
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, env)
    row = next(env.dataset(0))
    return rollouts, asyncio.run(rollouts.group(Prompt(0, row), "g0", model))


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def test_a_tool_episode_calls_tools_answers_errors_and_keeps_the_sampled_ids():
    model = ScriptedModel(SCRIPT)
    rollouts, group = run_group(config(), model)
    assert group.failed == 0 and len(group.samples) == 2
    assert group.rewards == [1.0, 1.0]
    assert group.episodes == [{"turns": 3, "tool_calls": 6, "tool_errors": 5,
                               "tokens": len(group.samples[0].tokens)}] * 2

    sample = group.samples[0]
    mine = [c for c in model.calls if c[0].startswith("g0-e0-")]
    assert [c[0] for c in mine] == ["g0-e0-t0", "g0-e0-t1", "g0-e0-t2"]
    # The model's turns are exactly the ids it sampled, trained on; everything else is not; and
    # each request's prompt is exactly the trajectory so far.
    model_spans = [(s, e) for s, e, m in spans(sample.loss_mask) if m == 1]
    assert [sample.tokens[s:e] for s, e in model_spans] == [c[2] for c in mine]
    for (s, _), (_, prompt, _) in zip(model_spans, mine):
        assert sample.tokens[:s] == prompt
    assert sample.logprobs[model_spans[0][0]] == -0.5 and sample.versions[model_spans[0][0]] == 3

    # Between the turns: the template's own rendering of the tool messages, in the order called.
    template = ChatTemplate.load(CHAT_MODEL)
    schemas = rollouts.kind.tool_episode.schemas
    raw = [{"role": "system", "content": Tools.system_prompt}, {"role": "user", "content": "What is 0 + 1?"}]
    for turn, text in enumerate(SCRIPT):
        raw.append({"role": "assistant", "content": text})
        if turn < len(TOOL_REPLIES):
            raw += [{"role": "tool", "content": reply} for reply in TOOL_REPLIES[turn]]
    whole = template.render(raw, add_generation_prompt=False, tools=schemas)
    assert TOKENIZER.decode(sample.tokens, skip_special_tokens=False) == whole.removesuffix("\n")
    for (_, end), (start, _) in zip(model_spans, model_spans[1:]):
        between = TOKENIZER.decode(sample.tokens[end:start], skip_special_tokens=False)
        assert between.startswith("\n<|im_start|>user\n<tool_response>\n") and between.endswith("<|im_start|>assistant\n")


def test_the_reward_reads_the_conversation_in_openai_form():
    seen = []

    class Recording(Tools):
        def reward(self, messages, row):
            seen.append(messages)
            return 0.0

    from orchestrator.prompts.queue import Prompt
    from orchestrator.rendering.tokenizer import load_tokenizer

    cfg = config()
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, Recording())
    asyncio.run(rollouts.group(Prompt(0, {"prompt": "hi", "answer": "1"}), "g", ScriptedModel(SCRIPT)))
    messages = seen[0]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant",
                                             "tool", "tool", "tool", "tool", "assistant"]
    assert messages[2] == {"role": "assistant", "content": "I will add.", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"id": "call_0_1", "type": "function", "function": {"name": "nope", "arguments": {}}}]}
    assert messages[3] == {"role": "tool", "tool_call_id": "call_0_0", "name": "add", "content": "5"}
    # The unreadable call has no tool_calls entry but its error reply is there.
    assert len(messages[5]["tool_calls"]) == 3 and messages[7]["name"] == ""
    assert messages[-1] == {"role": "assistant", "content": "1"}


def test_max_turns_and_seq_len_end_an_episode():
    _, group = run_group(config(max_turns=2), ScriptedModel(SCRIPT))
    assert [e["turns"] for e in group.episodes] == [2, 2]
    assert [e["tool_calls"] for e in group.episodes] == [2, 2]  # the last turn's calls are not run
    _, full = run_group(config(), ScriptedModel(SCRIPT))
    second_turn = [s for s, _, m in spans(full.samples[0].loss_mask) if m == 1][1]
    # Room for the first turn and the tool replies, but not for a second turn's first token.
    _, group = run_group(config(seq_len=second_turn), ScriptedModel(SCRIPT))
    assert [e["turns"] for e in group.episodes] == [1, 1]
    assert group.samples[0].tokens == full.samples[0].tokens[:len(group.samples[0].tokens)]
    assert second_turn - 200 < len(group.samples[0].tokens) < second_turn


def test_a_reward_that_raises_fails_only_its_rollouts():
    class Raises(Tools):
        def reward(self, messages, row):
            raise KeyError("answer")

    from orchestrator.prompts.queue import Prompt
    from orchestrator.rendering.tokenizer import load_tokenizer

    cfg = config()
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, Raises())
    group = asyncio.run(rollouts.group(Prompt(0, {"prompt": "hi"}), "g", ScriptedModel(SCRIPT)))
    assert group.failed == 2 and group.samples == []


@pytest.mark.parametrize("env, orchestrator, message", [
    ("test_tool_episode:NoReward", {}, "a tool environment needs a reward(messages, row) method"),
    ("test_tool_episode:Tools", {"tools": {"parser": "test_tool_episode:Missing"}},
     "orchestrator.tools.parser = 'test_tool_episode:Missing': module 'test_tool_episode' has no 'Missing'"),
    ("test_tool_episode:Tools", {"prompts": {"chat": "off"}}, "has tools, which need a chat template"),
])
def test_bad_tool_environments_are_named_before_start(env, orchestrator, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        orchestrator_code(config(env, **orchestrator))


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # Renders an assistant turn's calls only while it is the last message: appending a tool
    # message changes the text before it.
    template = tmp_path / "drift.jinja"
    template.write_text(
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{%- if loop.last and m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}{% endif %}"
        "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
    with pytest.raises(ConfigError, match="renders an assistant turn differently once a tool message follows"):
        orchestrator_code(config(prompts={"chat_template": str(template)}))


def test_schemas_reach_the_template():
    cfg = config()
    from orchestrator.rendering.tokenizer import load_tokenizer

    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, Tools())
    text = rollouts.kind.tool_episode.template.render([{"role": "user", "content": "x"}], True,
                                                  rollouts.kind.tool_episode.schemas)
    assert json.dumps(rollouts.kind.tool_episode.schemas[0]) in text


def test_tool_conversations_render_as_transformers_renders_them():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(CHAT_MODEL)
    schemas = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    conversation = [
        {"role": "system", "content": "Use the tools."}, {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}},
            {"id": "call_0_1", "type": "function", "function": {"name": "add", "arguments": {"a": 3}}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "name": "add", "content": "2"},
        {"role": "tool", "tool_call_id": "call_0_1", "name": "add", "content": "3"},
    ]
    ours = ChatTemplate.load(CHAT_MODEL)
    for messages in (conversation[:2], conversation, conversation[1:]):
        for tools in (schemas, None):
            assert ours.render(messages, True, tools) == hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_an_eval_environment_samples_with_the_evaluation_settings_not_the_runs(temperature):
    """[[orchestrator.eval.environments]] runs the environment's kind with [orchestrator.eval]'s
    temperature (greedy by default) and, greedy, without the run's truncation; the run's own
    rollouts keep theirs. (A copy of the settings that set keys the sampling table no longer
    held once evaluated the held-out episodes at the run's T = 1.)"""
    from orchestrator.evaluation.environments import EnvironmentEval
    from orchestrator.rendering.tokenizer import load_tokenizer
    from rl.config.datasets import EvalConfig, EvalEnvironment

    cfg = config(sampling={"temperature": 1.0, "top_k": 5})
    rollouts = Rollouts(cfg, load_tokenizer(cfg.model), {}, None, Tools())
    evaluation = EnvironmentEval(rollouts, EvalEnvironment(name="held", **{"class": "test_tool_episode:Tools"}),
                                 EvalConfig(temperature=temperature, rows=2))
    sampling = evaluation.kind.sampling(None)
    assert (sampling.temperature, sampling.top_k) == (temperature, 5 if temperature else -1)
    assert (rollouts.kind.sampling(None).temperature, rollouts.kind.sampling(None).top_k) == (1.0, 5)
