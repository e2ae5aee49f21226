"""The text environment kind: `orchestrator.environment.class` names a class with dataset(seed)
and episode(row) (orchestrator/rollout/environment.py). Each episode talks in raw text: its start, the
model's completion, the environment's observation, and so on; the model's ids are trained on,
the rest is context."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from orchestrator.rendering import Opening
from orchestrator.rollout.environment import Turn
from orchestrator.rollout.environment_base import EnvironmentKind
from orchestrator.rollout.kind import Aborted, Generate, Trajectory
from rl.config import RunConfig


class TextEpisodes(EnvironmentKind):
    """Raw text, the tokenizer's own special tokens: the renderer is not used, no stop ids
    beyond the sampling settings' own."""

    @classmethod
    def start_up(cls, cfg: RunConfig, env) -> Callable[[object], Opening]:
        return lambda tokenizer: lambda row: opening_tokens(env, tokenizer, row)

    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        o, encode = self.settings, self.toolkit.encode
        try:
            episode = self.env.episode(row)
            t = Trajectory([], [], [], [], 0.0)
            t.add(encode(episode.start()))
        except Exception as e:
            return self.failed(eid, e)
        for turn_index in range(o.environment.max_turns):
            response = await generate(self.toolkit.request(f"{eid}-t{turn_index}", t.tokens, 1, self.env_sampling))
            sample = response.samples[0]
            if sample.finish_reason == "abort":
                raise Aborted(eid)
            t.add(sample.token_ids, sample)
            t.truncated = sample.finish_reason == "length"
            try:
                turn = episode.step(self.toolkit.decode(sample.token_ids))
                if inspect.isawaitable(turn):
                    turn = await turn
                if not isinstance(turn, Turn):
                    raise TypeError(f"{type(episode).__name__}.step returned {type(turn).__name__}, not Turn")
            except Exception as e:
                return self.failed(eid, e)
            t.reward += turn.reward
            if turn.done or not turn.observation or turn_index == o.environment.max_turns - 1:
                break  # (a last observation no model turn answers would only cost tokens)
            observation = encode(turn.observation, add_special_tokens=False)
            if len(t.tokens) + len(observation) >= self.cfg.seq_len:
                break  # no room for another model turn: the episode ends truncated
            t.add(observation)
        return t


def opening_tokens(env, tokenizer, row: dict) -> int | None:
    """Tokens of the start of `row`'s episode; None where building or starting it raises (at
    run time: that one rollout fails)."""
    try:
        episode = env.episode(row)
    except Exception:
        return None
    try:
        return len(tokenizer.encode(episode.start(), add_special_tokens=True).ids)
    except Exception:
        return None
    finally:  # an episode may hold a process or a connection
        closed = getattr(episode, "close", lambda: None)()
        if inspect.iscoroutine(closed):
            asyncio.run(closed)  # start-up checks run before any event loop
