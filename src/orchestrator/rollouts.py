"""From one prompt to one scored group of samples: generation (single-turn: one request of n
completions; multi-turn: n episodes, one request per model turn), rewards, group-relative
advantages, the optional teacher's per-token signal.

`generate` is handed in by the scheduler (orchestrator/orchestrator.py): it pins the group to a server and
records each request id so a cancelled group can be aborted on that server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import aiohttp
import jinja2
from tokenizers import Tokenizer

from orchestrator.advantages import group_advantages
from orchestrator.environment import Environment, ToolEnvironment, Turn
from orchestrator.prompts import Prompt
from orchestrator.quiet import Quiet
from orchestrator.scoring import Teacher, combine
from orchestrator.sources import Renderer, RowError, Source, configured_sources, mix
from orchestrator.tokenizer import load_tokenizer
from orchestrator.tool_episode import TemplateDrift, ToolEpisode
from orchestrator.tool_parsers import tool_parser
from orchestrator.tools import load_tools
from rl.batch import Sample
from rl.callables import load_callable
from rl.config import ConfigError, RunConfig
from rl.dataset_config import Sampling
from rl.inference_api import GeneratedSample, GenerateRequest, GenerateResponse, InferenceClient

log = logging.getLogger("orchestrator")

Generate = Callable[[GenerateRequest], Awaitable[GenerateResponse]]


async def gather_or_cancel(coros) -> list:
    """asyncio.gather, except that when one fails the others are cancelled rather than left to
    run on (sending requests for a group that already failed)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Aborted(Exception):
    """The server aborted a request of this group (it was cancelled, or the server is going down)."""


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample]
    failed: int
    """Rollouts of this group that failed (reward or environment raised or timed out)."""
    truncated: int = 0
    """Completions cut at max_tokens (orchestrator.overlong says what became of them)."""
    components: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per sample: the named parts of its reward (empty for a plain float)."""
    episodes: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per sample of a tool environment: its turns, tool calls, tool errors, tokens."""
    error: str = ""
    """A group left without samples: the last error of its reward or environment."""

    @functools.cached_property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def model_tokens(self) -> int:
        return sum(s.num_model_tokens for s in self.samples)


@dataclass
class Trajectory:
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    components: dict[str, float] = dataclasses.field(default_factory=dict)
    truncated: bool = False
    episode: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, ids: list[int], model: GeneratedSample | None = None) -> None:
        self.tokens += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += model.logprobs if model else [0.0] * len(ids)
        self.versions += model.versions if model else [-1] * len(ids)


class Rollouts:
    def __init__(self, cfg: RunConfig, tokenizer, sources: dict[str, Source], teacher: Teacher | None,
                 env: Environment | ToolEnvironment | None):
        self.cfg, self.o = cfg, cfg.orchestrator
        self.tokenizer, self.sources, self.teacher, self.env = tokenizer, sources, teacher, env
        # A Rust tokenizer (orchestrator/tokenizer.py), or the one behind a fast HF tokenizer,
        # called directly: the HF wrapper costs ~10x more per call, which shows at thousands of
        # groups per second.
        self.fast = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        # A tool environment talks through the chat template, a text environment in raw text.
        self.tool_env = env is not None and hasattr(env, "tools")
        self.renderer = Renderer(self.o, cfg.model, self.fast, self.encode) if env is None or self.tool_env else None
        self.env_sampling = self.o.sampling()  # an environment's turns: the orchestrator-level settings
        self.tool_episode = self._tool_episode(env) if self.tool_env else None
        self.env_error = ""  # the latest episode failure (Group.error)
        self.env_quiet = Quiet(log)  # an environment that always raises would say so per episode

    @classmethod
    def from_config(cls, cfg: RunConfig, session: aiohttp.ClientSession) -> Rollouts:
        """A run's: its environment or datasets, its teacher if any."""
        o = cfg.orchestrator
        env = load_callable(o.environment, "orchestrator.environment")(**o.environment_args) if o.environment else None
        sources = {} if env else {s.name: s for s in configured_sources(cfg, session)}
        teacher = None
        if o.teacher_url:
            teacher = Teacher(InferenceClient(o.teacher_url, session, cfg.inference.api_token),
                              o.teacher_coef, o.request_timeout_s)
        return cls(cfg, load_tokenizer(cfg.model), sources, teacher, env)

    def _tool_episode(self, env) -> ToolEpisode:
        key = "orchestrator.environment"
        if self.renderer.template is None:
            raise ConfigError(f"{key} = {self.o.environment!r} has tools, which need a chat template: "
                              f"{self.cfg.model} has none (set orchestrator.chat_template)")
        try:
            tools = load_tools(env.tools, f"{key} = {self.o.environment!r}: tools")
        except TypeError as e:
            raise ConfigError(str(e)) from None
        return ToolEpisode(env, tools, self.renderer.template, self.fast, self.encode, self.decode,
                           tool_parser(self.o.tool_parser), self.o.tool_timeout_s, self.o.max_turns, self.cfg.seq_len)

    def draws(self) -> Iterator[tuple[str, object]]:
        """The run's stream of (dataset name, draw) for orchestrator/prompts.py."""
        if self.env is not None:
            return (("", row) for row in self.env.dataset(self.cfg.seed))
        return mix(list(self.sources.values()), self.cfg.seed)

    def fetch(self, source: str, draw) -> tuple[dict, str]:
        """A draw's (row, where it came from)."""
        if self.env is not None:
            return draw, "orchestrator.environment"
        return self.sources[source].fetch(draw)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.fast is not None:
            return self.fast.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode_all(self, ids: list[list[int]]) -> list[str]:
        if self.fast is not None:  # one by one: decode_batch's thread pool costs more than it saves here
            return [self.fast.decode(x, skip_special_tokens=True) for x in ids]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.decode_all([ids])[0]

    def request(self, request_id: str, tokens: list[int], n: int, sampling: Sampling,
                where: str = "a prompt") -> GenerateRequest:
        # A teacher scores the finished sequence plus one generated token: leave it that room.
        room = self.cfg.seq_len - len(tokens) - (1 if self.teacher is not None else 0)
        if room < 1:
            raise RowError(f"{where}: {len(tokens)} tokens leave no room to generate within seq_len {self.cfg.seq_len}",
                           # max_tokens is no help: generation is already cut to the room left (below)
                           "raise seq_len or shorten the prompts (system prompt, tool schemas)")
        stop_ids = self.renderer.stop_token_ids if self.renderer else []
        return GenerateRequest(request_id=request_id, prompt_token_ids=tokens, n=n,
                               max_tokens=min(sampling.max_tokens, room), temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                               stop=list(sampling.stop), stop_token_ids=stop_ids)

    async def group(self, prompt: Prompt, gid: str, generate: Generate) -> Group:
        if self.env is None:
            trajectories = await self.single_turn(prompt, gid, generate)
        else:
            run = self.tool_run if self.tool_env else self.episode
            trajectories = await gather_or_cancel(
                run(prompt.row, f"{gid}-e{i}", generate) for i in range(self.o.group_size))
        kept = [t for t in trajectories if t is not None]
        failed = len(trajectories) - len(kept)
        if len(kept) < 2:  # no group-relative signal left
            return Group(prompt, [], failed + len(kept), error=self.last_error(prompt))
        advantages = group_advantages([t.reward for t in kept], self.o.normalize_advantages)
        sampling = self.env_sampling if self.env is not None else self.source(prompt).ds.sampling
        samples = [Sample(t.tokens, self.trained_mask(t), t.logprobs, [a * m for m in t.loss_mask], t.versions,
                          t.reward, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p)
                   for t, a in zip(kept, advantages)]
        if self.teacher is not None:
            await self.add_teacher_signal(samples, gid)
        return Group(prompt, samples, failed, sum(t.truncated for t in kept), [t.components for t in kept],
                     [t.episode for t in kept if t.episode])

    def last_error(self, prompt: Prompt) -> str:
        """The latest failure of what scores `prompt`'s rollouts (its reward, or the environment)."""
        if self.env is not None:
            return self.env_error
        reward = self.source(prompt).reward
        return f"reward {reward.url or reward.spec} {reward.last_error}" if reward and reward.last_error else ""

    def source(self, prompt: Prompt) -> Source:
        # "": a prompt checkpointed before datasets had names, when there was only one.
        return self.sources[prompt.source] if prompt.source else next(iter(self.sources.values()))

    def trained_mask(self, t: Trajectory) -> list[int]:
        # overlong = "mask": a cut completion still counts in its group's mean reward (the
        # advantages above), but none of its tokens is trained on (DAPO's overlong filtering).
        return [0] * len(t.loss_mask) if t.truncated and self.o.overlong == "mask" else t.loss_mask

    async def single_turn(self, prompt: Prompt, gid: str, generate: Generate) -> list[Trajectory | None]:
        source = self.source(prompt)
        text, ids = self.renderer.render(source.ds, prompt.row, prompt.where or f"row {prompt.index}")
        request = self.request(gid, ids, self.o.group_size, source.ds.sampling,
                               f"{prompt.where or source.name}, draw {prompt.index}")
        response = await generate(request)
        if any(s.finish_reason == "abort" for s in response.samples):
            raise Aborted(gid)
        completions = self.decode_all([s.token_ids for s in response.samples])
        scores = (await source.reward.score(text, completions, prompt.row) if source.reward
                  else [0.0] * len(completions))
        out = []
        for s, score in zip(response.samples, scores):
            if score is None:
                out.append(None)
                continue
            reward, components = combine(score, source.reward_weights)
            t = Trajectory([], [], [], [], reward, components, s.finish_reason == "length")
            t.reward -= self.overlong_penalty(len(s.token_ids), request.max_tokens, t)
            t.add(ids)
            t.add(s.token_ids, s)
            out.append(t)
        return out

    def overlong_penalty(self, length: int, max_tokens: int, t: Trajectory) -> float:
        """DAPO's soft overlong punishment: 0 up to max_tokens - overlong_buffer, then growing
        linearly to overlong_penalty at max_tokens (logged as a reward component)."""
        if self.o.overlong != "penalty":
            return 0.0
        buffer = min(self.o.overlong_buffer, max_tokens)
        penalty = self.o.overlong_penalty * max(0, length - (max_tokens - buffer)) / buffer
        t.components = {**t.components, "overlong_penalty": -penalty}
        return penalty

    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        """One multi-turn episode; None if the environment raised (that rollout alone fails)."""
        try:
            episode = self.env.episode(row)
            t = Trajectory([], [], [], [], 0.0)
            t.add(self.encode(episode.start()))
        except Exception as e:
            return self._env_failed(eid, e)
        for turn_index in range(self.o.max_turns):
            response = await generate(self.request(f"{eid}-t{turn_index}", t.tokens, 1, self.env_sampling))
            sample = response.samples[0]
            if sample.finish_reason == "abort":
                raise Aborted(eid)
            t.add(sample.token_ids, sample)
            t.truncated = sample.finish_reason == "length"
            try:
                turn = episode.step(self.decode(sample.token_ids))
                if inspect.isawaitable(turn):
                    turn = await turn
                if not isinstance(turn, Turn):
                    raise TypeError(f"{type(episode).__name__}.step returned {type(turn).__name__}, not Turn")
            except Exception as e:
                return self._env_failed(eid, e)
            t.reward += turn.reward
            if turn.done or not turn.observation or turn_index == self.o.max_turns - 1:
                break  # (a last observation no model turn answers would only cost tokens)
            observation = self.encode(turn.observation, add_special_tokens=False)
            if len(t.tokens) + len(observation) >= self.cfg.seq_len:
                break  # no room for another model turn: the episode ends truncated
            t.add(observation)
        return t

    async def tool_run(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        """One tool-calling episode (orchestrator/tool_episode.py); None if the template or the
        reward failed (that rollout alone fails; a tool's failure is the model's to read)."""
        t = Trajectory([], [], [], [], 0.0)

        async def sample_turn(request_id: str, tokens: list[int]) -> GeneratedSample:
            sample = (await generate(self.request(request_id, tokens, 1, self.env_sampling))).samples[0]
            if sample.finish_reason == "abort":
                raise Aborted(eid)
            t.truncated = sample.finish_reason == "length"
            return sample

        try:
            log = await self.tool_episode.run(row, eid, sample_turn, t.add)
        except (TemplateDrift, jinja2.TemplateError) as e:
            return self._env_failed(eid, e)
        try:
            t.reward = await self.tool_episode.reward(log, row)
        except Exception as e:
            return self._env_failed(eid, e)
        t.episode = log.stats()
        return t

    def _env_failed(self, eid: str, e: Exception) -> None:
        self.env_error = f"{type(e).__name__}: {e}"
        self.env_quiet.warn(self.env_error, f"episode {eid} failed in {self.o.environment}: {self.env_error}")
        return None

    async def add_teacher_signal(self, samples: list[Sample], gid: str) -> None:
        teacher_lps = await gather_or_cancel(
            self.teacher.logprobs(f"{gid}-teacher{i}", s.tokens) for i, s in enumerate(samples))
        for s, lp in zip(samples, teacher_lps):
            extra = self.teacher.advantages(lp, s.logprobs, s.loss_mask)
            s.advantages = [a + x for a, x in zip(s.advantages, extra)]
