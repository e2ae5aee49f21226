"""From one prompt to one scored group of samples: the run's rollout kind (orchestrator/rollout/
kind.py: datasets, a text or a tool environment) makes the group's trajectories; here they
become samples: group-relative advantages, overlong masking, the optional teacher's per-token signal.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import aiohttp
from tokenizers import Tokenizer

from orchestrator.prompts import Prompt, RowError, Rows, Source
from orchestrator.rendering import ImagePrompt, Renderer, load_tokenizer, request_fields
from orchestrator.rewards import Reward, Teacher, configured_rewards
from orchestrator.rollout.advantages import group_advantages
from orchestrator.rollout.kind import Generate, RolloutKind, Trajectory, gather_or_cancel
from orchestrator.rollout.registry import kind_of
from rl.batch import Sample
from rl.config import RunConfig
from rl.config.datasets import Sampling
from rl.inference_api import GenerateRequest, InferenceClient


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample]
    failed: int
    """Rollouts of this group that failed (reward or environment raised or timed out)."""
    truncated: int = 0
    """Completions cut at max_tokens (orchestrator.overlong.mode says what became of them)."""
    components: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per sample: the named parts of its reward (empty for a plain float)."""
    episodes: list[dict[str, float]] = dataclasses.field(default_factory=list)
    """Per sample of a tool environment: its turns, tool calls, tool errors, tokens."""
    error: str = ""
    """A group left without samples: the last error of its reward or environment."""

    @property
    def short(self) -> bool:
        """Kept with fewer than group_size rollouts (some failed, enough finished)."""
        return bool(self.samples) and self.failed > 0

    @functools.cached_property
    def oldest_version(self) -> int:
        return min(s.oldest_version for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def model_tokens(self) -> int:
        return sum(s.num_model_tokens for s in self.samples)


class Rollouts:
    """Builds the run's rollout kind once (orchestrator/rollout/registry.py) and is its Toolkit:
    the tokenizer's way in and out, and the generate request."""

    def __init__(self, cfg: RunConfig, tokenizer, sources: dict[str, Source], teacher: Teacher | None, env,
                 rewards: dict[str, Reward | None] | None = None):
        """`sources`: the datasets by name (orchestrator/prompts/); `rewards`: their rewards by the same
        names (orchestrator/rewards/); `env`: the built environment, else None."""
        self.cfg, self.settings = cfg, cfg.orchestrator
        self.tokenizer, self.teacher = tokenizer, teacher
        # A Rust tokenizer (orchestrator/rendering/tokenizer.py), or the one behind a fast HF tokenizer,
        # called directly: the HF wrapper costs ~10x more per call, which shows at thousands of
        # groups per second.
        self.fast = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
        # Datasets and tool episodes render through it; evaluation's datasets too, whatever the kind.
        self.renderer = Renderer(self.settings, cfg.model, self.fast, self.encode)
        self.kind: RolloutKind = kind_of(env)(cfg, self, self.renderer, sources, env, rewards)

    @classmethod
    def from_config(cls, cfg: RunConfig, session: aiohttp.ClientSession, rows: Rows | None = None) -> Rollouts:
        """A run's: the environment or datasets its rows come from (`rows`, the prompts station's;
        made from the config if not given), the datasets' rewards, its teacher if any."""
        o = cfg.orchestrator
        rows = rows or Rows.for_run(cfg)
        rewards = configured_rewards(cfg, session) if rows.sources else {}
        teacher = None
        if o.teacher.url:
            teacher = Teacher(InferenceClient(o.teacher.url, session, cfg.inference.api_token),
                              o.teacher.coef, o.timeouts.request_s)
        return cls(cfg, load_tokenizer(cfg.model), rows.sources, teacher, rows.env, rewards)

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
                where: str = "a prompt", stop_token_ids: list[int] | None = None,
                images: ImagePrompt | None = None) -> GenerateRequest:
        """`stop_token_ids`: where completions end besides the sampling's stops (default: the
        run's kind's). `images`: the prompt's images (`tokens` then its ids with the
        placeholders expanded, which the room is measured on; the request carries one
        placeholder per image and the images: orchestrator/prompts/images.py)."""
        # A teacher scores the finished sequence plus one generated token: leave it that room.
        room = self.cfg.seq_len - len(tokens) - (1 if self.teacher is not None else 0)
        if room < 1:
            raise RowError(f"{where}: {len(tokens)} tokens leave no room to generate within seq_len {self.cfg.seq_len}",
                           # max_tokens is no help: generation is already cut to the room left (below)
                           "raise seq_len or shorten the prompts (system prompt, tool schemas)")
        prompt = request_fields(images) if images is not None else {"prompt_token_ids": tokens}
        return GenerateRequest(request_id=request_id, **prompt, n=n,
                               max_tokens=min(sampling.max_tokens, room), temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                               stop=list(sampling.stop), kept_sets=self.records_kept_sets(sampling),
                               routed_experts=self.cfg.inference.record_routing,
                               stop_token_ids=self.kind.stop_token_ids if stop_token_ids is None else stop_token_ids)

    def records_kept_sets(self, sampling: Sampling) -> bool:
        """orchestrator.sampling.record_kept_sets, where sampling truncates (else the set is the vocabulary)."""
        return (self.cfg.orchestrator.sampling.record_kept_sets and sampling.temperature > 0
                and (sampling.top_k > 0 or sampling.top_p < 1 or sampling.min_p > 0))

    async def group(self, prompt: Prompt, gid: str, generate: Generate) -> Group:
        trajectories = await self.kind.trajectories(prompt, gid, generate)
        kept = [t for t in trajectories if t is not None]
        failed = len(trajectories) - len(kept)
        # The rest train, advantages over those that finished (a rollout that raised costs only
        # itself); too few left give no group-relative signal worth the step.
        if len(kept) < self.settings.scheduling.min_group_episodes:
            return Group(prompt, [], failed + len(kept), error=self.kind.last_error(prompt))
        advantages = group_advantages([t.reward for t in kept], self.settings.scheduling.normalize_advantages)
        sampling = self.kind.sampling(prompt)
        # An episode of several samples (Trajectory.parts) gives each its advantage.
        pieces = [(p, a) for t, a in zip(kept, advantages) for p in (t, *t.parts)]
        samples = [Sample(t.tokens, self.trained_mask(t), t.logprobs, [a * m for m in t.loss_mask], t.versions,
                          t.reward, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p, kept_counts=t.kept_counts, kept_ids=t.kept_ids,
                          images=t.images, **t.routing_fields())
                   for t, a in pieces]
        if self.teacher is not None:
            await self.add_teacher_signal(samples, gid)
        return Group(prompt, samples, failed, sum(t.truncated for t, _ in pieces), [t.components for t, _ in pieces],
                     [t.episode for t in kept if t.episode])

    def trained_mask(self, t: Trajectory) -> list[int]:
        # overlong.mode = "mask": a cut completion still counts in its group's mean reward (the
        # advantages above), but none of its tokens is trained on (DAPO's overlong filtering).
        return [0] * len(t.loss_mask) if t.truncated and self.settings.overlong.mode == "mask" else t.loss_mask

    async def add_teacher_signal(self, samples: list[Sample], gid: str) -> None:
        teacher_lps = await gather_or_cancel(
            self.teacher.logprobs(f"{gid}-teacher{i}", s.tokens) for i, s in enumerate(samples))
        for s, lp in zip(samples, teacher_lps):
            extra = self.teacher.advantages(lp, s.logprobs, s.loss_mask)
            s.advantages = [a + x for a, x in zip(s.advantages, extra)]
