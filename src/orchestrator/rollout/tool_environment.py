"""The tool environment kind: `orchestrator.environment.class` names a class with `tools` (functions),
dataset(seed) and reward(messages, row) (orchestrator/rollout/environment.py). Each of a group's episodes
is a conversation through the chat template in which the model calls the tools
(orchestrator/rollout/tool_episode.py runs one); the environment's reward scores the whole conversation."""

from __future__ import annotations

from collections.abc import Callable

import jinja2

from orchestrator.callables import load_callable
from orchestrator.rendering import ChatTemplate, ImageError, ImagePrompt, Opening, check_expanded, image_support
from orchestrator.rollout.agent_images import AgentImages
from orchestrator.rollout.environment_base import EnvironmentKind
from orchestrator.rollout.kind import Aborted, Generate, Toolkit, Trajectory
from orchestrator.rollout.tool_episode import TemplateDrift, ToolEpisode, opening_measure
from orchestrator.rollout.tool_functions import load_tools
from orchestrator.rollout.tool_parsers import PARSERS, tool_parser
from rl.config import ConfigError, RunConfig
from rl.inference_api import GeneratedSample


class ToolEpisodes(EnvironmentKind):
    fit_keys = ("orchestrator.sampling.max_tokens or shorten the environment's system prompt, tool schemas "
                "(docstrings) or questions")

    def __init__(self, cfg: RunConfig, toolkit: Toolkit, renderer, sources, env, rewards=None):
        super().__init__(cfg, toolkit, renderer, sources, env, rewards)
        self.stop_token_ids = renderer.stop_token_ids
        tools = self.settings.tools
        self.tool_episode = ToolEpisode(
            env, env_tools(cfg, env), needed_template(cfg, renderer.template), toolkit.fast, toolkit.encode,
            toolkit.decode, tool_parser(tools.parser), self.settings.timeouts.tool_s,
            self.settings.environment.max_turns, cfg.seq_len,
            AgentImages(renderer.template, renderer.image_support, toolkit.fast))

    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        """One tool-calling episode; None if the template or the reward failed (a tool's failure
        is the model's to read)."""
        t = Trajectory([], [], [], [], 0.0)

        async def sample_turn(request_id: str, tokens: list[int], images: ImagePrompt | None) -> GeneratedSample:
            request = self.toolkit.request(request_id, tokens, 1, self.env_sampling, images=images)
            response = await generate(request)
            sample = response.samples[0]
            if sample.finish_reason == "abort":
                raise Aborted(eid)
            if images is not None:  # the prompt the engine sampled after must be the one the trainer scores
                check_expanded(images, response.prompt_token_ids, request_id)
            t.truncated = sample.finish_reason == "length"
            return sample

        try:
            log = await self.tool_episode.run(row, eid, sample_turn, t.add)
        except (TemplateDrift, jinja2.TemplateError, ImageError) as e:
            return self.failed(eid, e)
        try:
            t.reward = await self.tool_episode.reward(log, row)
        except Exception as e:
            return self.failed(eid, e)
        t.episode, t.images = log.stats(), log.images
        return t

    @classmethod
    def start_up(cls, cfg: RunConfig, env) -> Callable[[object], Opening]:
        template, schemas = checked(cfg, env)
        return opening_measure(env, template, image_support(cfg.model), schemas)


def checked(cfg: RunConfig, env) -> tuple[ChatTemplate, list[dict]]:
    """A tool environment's tools describe themselves, it has a reward, its parser loads, and the
    chat template renders a tool call and its result as a continuation (orchestrator/rollout/tool_episode.py).
    Returns the template and the tools' schemas, for measuring its prompts."""
    o, key = cfg.orchestrator, f"orchestrator.environment.class = {cfg.orchestrator.environment.class_!r}"
    schemas = [t.schema for t in env_tools(cfg, env).values()]
    if not callable(getattr(env, "reward", None)):
        raise ConfigError(f"{key}: a tool environment needs a reward(messages, row) method")
    if o.tools.parser not in PARSERS:
        load_callable(o.tools.parser, "orchestrator.tools.parser")
    template = needed_template(cfg, ChatTemplate.configured(o, cfg.model))
    name = schemas[0]["function"]["name"] if schemas else "tool"
    asked = [{"role": "user", "content": "probe"}]
    called = asked + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": name, "arguments": {}}}]}]
    replied = called + [{"role": "tool", "tool_call_id": "call_0_0", "name": name, "content": "probe"}]
    try:
        template.render(asked, True, schemas)
        before, after = template.render(called, False, schemas), template.render(replied, True, schemas)
    except jinja2.TemplateError as e:
        raise ConfigError(f"{key}: the chat template ({template.origin}) fails on a tool call: {e}") from None
    if not after.startswith(before):
        raise ConfigError(f"{key}: the chat template ({template.origin}) renders an assistant turn differently "
                          "once a tool message follows it, so the ids trained on would not be those the model "
                          "saw; use a template that only appends")
    return template, schemas


def env_tools(cfg: RunConfig, env) -> dict:
    """The environment's tools, loaded (a ConfigError naming the one that cannot describe itself)."""
    try:
        return load_tools(env.tools, f"orchestrator.environment.class = {cfg.orchestrator.environment.class_!r}: tools")
    except TypeError as e:
        raise ConfigError(str(e)) from None


def needed_template(cfg: RunConfig, template: ChatTemplate | None) -> ChatTemplate:
    if template is None:
        raise ConfigError(f"orchestrator.environment.class = {cfg.orchestrator.environment.class_!r} has tools, "
                          f"which need a chat template: {cfg.model} has none (set orchestrator.prompts.chat_template)")
    return template
