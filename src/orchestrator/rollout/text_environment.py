"""The text environment kind: `orchestrator.environment.class` names a class with dataset(seed)
and episode(row) (orchestrator/rollout/environment.py). Each episode talks in raw text: its start, the
model's completion, the environment's observation, and so on; the model's ids are trained on,
the rest is context. A start or an observation may be a picture (a PIL image) or content parts
holding pictures (orchestrator/rollout/turn_images.py): each picture is the model's placeholder
token in the raw text, expanded as its processor expands it, and every later turn's request
carries the episode's pictures."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from orchestrator.rendering import ImageError, Opening, check_expanded, image_support
from orchestrator.rollout.agent_images import AgentImages
from orchestrator.rollout.environment import Turn
from orchestrator.rollout.environment_base import EnvironmentKind
from orchestrator.rollout.kind import Aborted, Generate, Toolkit, Trajectory
from orchestrator.rollout.turn_images import EpisodeImages, content_of
from rl.config import RunConfig


class TextEpisodes(EnvironmentKind):
    """Raw text, the tokenizer's own special tokens: the renderer is not used, no stop ids
    beyond the sampling settings' own."""

    @classmethod
    def start_up(cls, cfg: RunConfig, env) -> Callable[[object], Opening]:
        support = image_support(cfg.model)

        def opening(tokenizer) -> Callable[[dict], int | None]:
            # A picture counts as the model reads it: its placeholder expanded (one token for a
            # model that reads text only, whose episode fails at run time on it anyway).
            per_picture = len(tokenizer.encode(support.expansion(), add_special_tokens=False).ids) if support else 1
            return lambda row: opening_tokens(env, tokenizer, row, per_picture)

        return opening

    def __init__(self, cfg: RunConfig, toolkit: Toolkit, renderer, sources, env, rewards=None):
        super().__init__(cfg, toolkit, renderer, sources, env, rewards)
        self.images = AgentImages(renderer.template, renderer.image_support, toolkit.fast)

    async def episode(self, row: dict, eid: str, generate: Generate) -> Trajectory | None:
        o = self.settings
        pictures = EpisodeImages(self.images, self.toolkit.encode)
        try:
            episode = self.env.episode(row)
            t = Trajectory([], [], [], [], 0.0)
            start = pictures.raw_text(turn_content(episode.start(), episode, "start"), "start")
            t.add(pictures.keep(pictures.piece(*start, add_special_tokens=True, wrote="start()")))
        except Exception as e:
            return self.failed(eid, e)
        for turn_index in range(o.environment.max_turns):
            where, images = f"{eid}-t{turn_index}", pictures.request(t.tokens)
            response = await generate(self.toolkit.request(where, t.tokens, 1, self.env_sampling, images=images))
            sample = response.samples[0]
            if sample.finish_reason == "abort":
                raise Aborted(eid)
            if images is not None:
                try:  # the prompt the engine sampled after must be the one the trainer scores
                    check_expanded(images, response.prompt_token_ids, where)
                except ImageError as e:
                    return self.failed(eid, e)
            t.add(sample.token_ids, sample)
            pictures.sampled(sample.token_ids)
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
            try:
                said = f"turn {turn_index}: observation"
                observation = pictures.piece(*pictures.raw_text(turn_content(turn.observation, episode, said), said),
                                             wrote="the observation")
            except (ImageError, TypeError) as e:
                return self.failed(eid, e)
            if len(t.tokens) + len(observation.token_ids) >= self.cfg.seq_len or not pictures.readable(observation):
                break  # no room for another model turn (or no way to send it): the episode ends truncated
            t.add(pictures.keep(observation))
        t.images = pictures.pngs
        return t


def turn_content(value, episode, what: str) -> str | list[dict]:
    """An episode's start or observation as text or content parts with pictures
    (orchestrator/rollout/turn_images.py); TypeError naming it otherwise."""
    content = content_of(value)
    if content is None:
        raise TypeError(f"{type(episode).__name__}'s {what} is {type(value).__name__}: text, a picture "
                        "(a PIL image) or a list of content parts is expected")
    return content


def opening_tokens(env, tokenizer, row: dict, per_picture: int = 1) -> int | None:
    """Tokens of the start of `row`'s episode, each picture `per_picture` tokens; None where
    building or starting it raises (at run time: that one rollout fails)."""
    try:
        episode = env.episode(row)
    except Exception:
        return None
    try:
        start = content_of(episode.start())
        parts = [] if isinstance(start, str) else start
        text = "".join(p.get("text", "") for p in parts) if parts else start
        pictures = sum(p.get("type") != "text" for p in parts)
        return len(tokenizer.encode(text, add_special_tokens=True).ids) + pictures * per_picture
    except Exception:
        return None
    finally:  # an episode may hold a process or a connection
        closed = getattr(episode, "close", lambda: None)()
        if inspect.iscoroutine(closed):
            asyncio.run(closed)  # start-up checks run before any event loop
