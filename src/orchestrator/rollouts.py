"""From one prompt to one scored group of samples: generation (single-turn: one request of n
completions; multi-turn: n episodes, one request per model turn), rewards, group-relative
advantages, the optional teacher's per-token signal.

`generate` is handed in by the scheduler (orchestrator/main.py): it pins the group to a server and
records each request id so a cancelled group can be aborted on that server.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from orchestrator.advantages import group_advantages
from orchestrator.environment import Environment, Turn
from orchestrator.prompts import Prompt
from orchestrator.scoring import Reward, Teacher
from rl.batch import Sample
from rl.config import RunConfig
from rl.inference_api import GeneratedSample, GenerateRequest, GenerateResponse

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


class RowError(Exception):
    """A row that can never make a rollout (no prompt, too long): dropped, not requeued."""


class Aborted(Exception):
    """The server aborted a request of this group (it was cancelled, or the server is going down)."""


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample]
    failed: int
    """Rollouts of this group that failed (reward or environment raised or timed out)."""

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

    def add(self, ids: list[int], model: GeneratedSample | None = None) -> None:
        self.tokens += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += model.logprobs if model else [0.0] * len(ids)
        self.versions += model.versions if model else [-1] * len(ids)


class Rollouts:
    def __init__(self, cfg: RunConfig, tokenizer, reward: Reward | None, teacher: Teacher | None,
                 env: Environment | None):
        self.cfg, self.o = cfg, cfg.orchestrator
        self.tokenizer, self.reward, self.teacher, self.env = tokenizer, reward, teacher, env
        # A Rust tokenizer (orchestrator/tokenizer.py), or the one behind a fast HF tokenizer,
        # called directly: the HF wrapper costs ~10x more per call, which shows at thousands of
        # groups per second.
        self.fast = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)

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

    def request(self, request_id: str, tokens: list[int], n: int) -> GenerateRequest:
        # A teacher scores the finished sequence plus one generated token: leave it that room.
        room = self.cfg.seq_len - len(tokens) - (1 if self.teacher is not None else 0)
        if room < 1:
            raise RowError(f"{len(tokens)} tokens leave no room to generate within seq_len {self.cfg.seq_len}")
        return GenerateRequest(request_id=request_id, prompt_token_ids=tokens, n=n,
                               max_tokens=min(self.o.max_tokens, room), temperature=self.o.temperature)

    async def group(self, prompt: Prompt, gid: str, generate: Generate) -> Group:
        if self.env is None:
            trajectories = await self.single_turn(prompt, gid, generate)
        else:
            trajectories = await gather_or_cancel(
                self.episode(prompt.row, f"{gid}-e{i}", generate) for i in range(self.o.group_size))
        kept = [t for t in trajectories if t is not None]
        failed = len(trajectories) - len(kept)
        if len(kept) < 2:  # no group-relative signal left
            return Group(prompt, [], failed + len(kept))
        advantages = group_advantages([t.reward for t in kept], self.o.normalize_advantages)
        samples = [Sample(t.tokens, t.loss_mask, t.logprobs, [a * m for m in t.loss_mask], t.versions, t.reward)
                   for t, a in zip(kept, advantages)]
        if self.teacher is not None:
            await self.add_teacher_signal(samples, gid)
        return Group(prompt, samples, failed)

    async def single_turn(self, prompt: Prompt, gid: str, generate: Generate) -> list[Trajectory | None]:
        text = prompt.row.get("prompt")
        if not isinstance(text, str):
            raise RowError(f"orchestrator.dataset: row {prompt.index} has no string 'prompt'")
        ids = self.encode(text)
        response = await generate(self.request(gid, ids, self.o.group_size))
        if any(s.finish_reason == "abort" for s in response.samples):
            raise Aborted(gid)
        completions = self.decode_all([s.token_ids for s in response.samples])
        rewards = (await self.reward.score(text, completions, prompt.row) if self.reward
                   else [0.0] * len(completions))
        out = []
        for s, r in zip(response.samples, rewards):
            if r is None:
                out.append(None)
                continue
            t = Trajectory([], [], [], [], r)
            t.add(ids)
            t.add(s.token_ids, s)
            out.append(t)
        return out

    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        """One multi-turn episode; None if the environment raised (that rollout alone fails)."""
        try:
            episode = self.env.episode(row)
            t = Trajectory([], [], [], [], 0.0)
            t.add(self.encode(episode.start()))
        except Exception as e:
            return self._env_failed(eid, e)
        for turn_index in range(self.o.max_turns):
            response = await generate(self.request(f"{eid}-t{turn_index}", t.tokens, 1))
            sample = response.samples[0]
            if sample.finish_reason == "abort":
                raise Aborted(eid)
            t.add(sample.token_ids, sample)
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

    def _env_failed(self, eid: str, e: Exception) -> None:
        log.warning("episode %s failed in %s: %s: %s", eid, self.o.environment, type(e).__name__, e)
        return None

    async def add_teacher_signal(self, samples: list[Sample], gid: str) -> None:
        teacher_lps = await gather_or_cancel(
            self.teacher.logprobs(f"{gid}-teacher{i}", s.tokens) for i, s in enumerate(samples))
        for s, lp in zip(samples, teacher_lps):
            extra = self.teacher.advantages(lp, s.logprobs, s.loss_mask)
            s.advantages = [a + x for a, x in zip(s.advantages, extra)]
