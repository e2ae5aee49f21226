"""Generation with version tags: /generate runs token ids straight on the engine
(AsyncLLM.generate, not through the OpenAI layer) and tags every sampled token with the policy
version that sampled it; /abort stops those engine requests.

Per-token versions come from vLLM's own weight-version labels: an update sets the engine's label
to the new version while the engine is paused (Generations.label, reload.py), the engine core
attaches the label to every step's output, and a finished request reports which of its tokens
each label sampled (CompletionOutput.weight_versions). That happens above the model runners, so
it holds on vLLM's V1 and V2 runners and with async scheduling. Adapter requests ignore the
labels: every token carries the version the adapter was loaded as (an adapter never changes once
loaded; a new version is a new adapter).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import HTTPException

from inference.adapters import Adapter, Adapters
from inference.kept_sets import kept_sets
from inference.multimodal import image_input
from rl.inference_api import (AbortRequest, GeneratedSample, GenerateRequest, GenerateResponse, RoutedExperts,
                              kept_set_bound)

FINISH_REASONS = ("stop", "length", "abort")


class Generation:
    """One /generate call: the engine requests "<request_id>-<i>" of its n samples."""

    def __init__(self, request_id: str, n: int):
        self.engine_ids = [f"{request_id}-{i}" for i in range(n)]
        self.aborted = False
        self.prompt_token_ids: list[int] | None = None  # with images: as the engine expanded them


@dataclass(frozen=True)
class WeightsInUse:
    """What one /generate call samples with: the base weights or an adapter."""

    version: int
    salt: str
    """The prefix cache salt: cached KV from other weights must not seed this call."""
    lora: object | None
    """The engine's LoRARequest; None: the base weights."""
    switches: bool
    """Whether the engine's version labels apply to its tokens (not for an adapter's)."""


class Generations:
    """The /generate calls in progress, the version they start on and the version switch points
    of their engine requests."""

    def __init__(self, seq_len: int, adapters: Adapters):
        self.seq_len = seq_len
        self.adapters = adapters
        self.engine = None
        self.version = 0
        # Cleared during an update: /generate calls wait on it before reading the version, so a
        # request registered at version v samples its first token with v's weights.
        self.serving = asyncio.Event()
        self.serving.set()
        # Why the engine's weights are no version's (a failed reload that could not be rolled
        # back: reload_failure.py), else "": then /generate answers 503 with it, as /health does.
        self.broken = ""
        self.reloads = 0
        # Engine requests that an /abort stopped while they ran (/health "aborted"): what shows a
        # caller that its aborts reached running work, not ids that had finished already.
        self.aborted = 0
        self.generations: dict[str, Generation] = {}
        # Engine request id -> the version it was registered at, for the engine requests in
        # progress; None for an adapter's (a reload does not switch it).
        self.running: dict[str, int | None] = {}
        # With inference.record_routing: the recorder's MoE layers, top_k and dtype (routes.py).
        self.routing: dict | None = None

    async def generate(self, body: GenerateRequest) -> GenerateResponse:
        self.check(body)
        adapter = self.adapters.lookup(body.lora)
        if body.request_id in self.generations:
            raise HTTPException(409, f"request_id: {body.request_id} is already generating")
        gen = self.generations[body.request_id] = Generation(body.request_id, body.n)
        # Counted from here, before any suspension: an unload that runs later sees it.
        if adapter:
            adapter.running += 1
        try:
            results = await self.run(gen, body, adapter)
        finally:
            del self.generations[body.request_id]
            if adapter:
                adapter.running -= 1
        return GenerateResponse(samples=[s for s, _ in results],
                                prompt_logprobs=results[0][1] if body.prompt_logprobs else None,
                                prompt_token_ids=gen.prompt_token_ids)

    async def abort(self, body: AbortRequest) -> dict:
        gens = [self.generations[r] for r in set(body.request_ids) if r in self.generations]
        for gen in gens:
            gen.aborted = True
        if gens:
            ids = [e for gen in gens for e in gen.engine_ids]
            # Counted by whether the engine holds them (running: from just before engine.generate
            # registers the request to its end), not by their finish reason: a request whose
            # caller is gone ends cancelled, not with "abort".
            running = sum(e in self.running for e in ids)
            # External ids: vLLM aborts every internal request made from each.
            await self.engine.abort(ids)
            self.aborted += running
        return {"aborted": len(gens)}

    def check(self, body: GenerateRequest) -> None:
        # Checked here, not left to the engine: its errors name neither the field nor seq_len.
        prompt_len, limit = len(body.prompt_token_ids), self.seq_len
        if prompt_len + body.max_tokens > limit:
            raise HTTPException(400, f"max_tokens: prompt ({prompt_len} tokens) + max_tokens "
                                     f"({body.max_tokens}) exceeds seq_len {limit}")
        vocab = self.engine.model_config.get_vocab_size()
        most = self.engine.model_config.max_logprobs  # -1: no limit
        if body.kept_sets and most != -1 and (need := kept_set_bound(body.top_k, vocab)) > most:
            raise HTTPException(400, f"kept_sets: a kept set of this sampling may hold {need} tokens (top_k "
                                     f"{body.top_k}, vocabulary {vocab}), more than the server reports per token "
                                     f"(inference.max_logprobs {most}): set top_k below it, or raise it")
        if body.routed_experts and self.routing is None:
            raise HTTPException(400, "routed_experts: this server does not record routing "
                                     "(start it with inference.record_routing = true, a mixture-of-experts model)")
        for field in ("prompt_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(body, field) if not 0 <= t < vocab]
            if bad:
                raise HTTPException(400, f"{field}: token ids {bad[:5]} outside the vocabulary "
                                         f"[0, {vocab})")

    def weights_in_use(self, adapter: Adapter | None) -> WeightsInUse:
        """Read once the server serves (not during an update)."""
        # Salted per reload: the prefix cache cannot always be reset (an in-flight update keeps
        # running requests' blocks), and KV computed by older weights must not seed a request
        # tagged with the new version. Adapter requests also per load: vLLM keys cached blocks
        # by adapter name and path, which a reload of rewritten files under the same name keeps.
        salt = f"reload-{self.reloads}"
        if adapter is None:
            return WeightsInUse(self.version, salt, None, switches=True)
        return WeightsInUse(adapter.version, f"{salt}-lora-{adapter.request.lora_int_id}", adapter.request,
                            switches=False)

    async def run(self, gen: Generation, body: GenerateRequest,
                  adapter: Adapter | None) -> list[tuple[GeneratedSample, list[float | None] | None]]:
        from vllm.inputs.engine import tokens_input

        try:
            await self.serving.wait()
            if self.broken:
                raise HTTPException(503, self.broken)
            weights = self.weights_in_use(adapter)
            # Rendered input (not a raw TokensPrompt) keeps vLLM off its tokenizer thread pool.
            prompt = tokens_input(body.prompt_token_ids, cache_salt=weights.salt)
            if body.images:
                prompt = await self.with_images(body, weights)
            # A TaskGroup: if one sample fails, the others are cancelled, which aborts their
            # engine requests instead of leaving them running for nobody.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.sample(gen, i, body, prompt, weights)) for i in range(body.n)]
        except* Exception as failed:
            raise failed.exceptions[0] from None  # what the exception handlers understand
        results = [t.result() for t in tasks]
        if body.routed_experts:
            await self.attach_routing(gen, results)
        return results

    async def with_images(self, body: GenerateRequest, weights: WeightsInUse):
        """The engine input of a prompt with images, rendered by vLLM's multi-modal processor
        (inference/multimodal.py)."""
        return await image_input(self.engine, body.prompt_token_ids, body.images, weights.salt, body.max_tokens,
                                 self.seq_len)

    async def attach_routing(self, gen: Generation, results: list[tuple[GeneratedSample, object]]) -> None:
        """Each sample's routed experts, taken from the workers once its engine request ended (one
        call for the n samples; worker 0's record: every tensor-parallel worker runs the same
        routers, and a server records with one data-parallel rank only: preflight.py
        routing_into_data_parallel)."""
        taken = (await self.engine.collective_rpc("asyncrl_take_routing", args=(gen.engine_ids,)))[0]
        for engine_id, (sample, _) in zip(gen.engine_ids, results):
            rows = taken.get(engine_id)
            if rows is not None:
                sample.routed_experts = RoutedExperts(**self.routing, **rows)

    async def sample(self, gen: Generation, i: int, body: GenerateRequest, prompt,
                     weights: WeightsInUse) -> tuple[GeneratedSample, list[float | None] | None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine_id = gen.engine_ids[i]
        vocab = self.engine.model_config.get_vocab_size()
        params = SamplingParams(
            n=1, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            max_tokens=body.max_tokens, stop=body.stop or None, stop_token_ids=body.stop_token_ids,
            # The sampled token's logprob; with kept_sets, enough of the top ones to hold its kept set.
            logprobs=kept_set_bound(body.top_k, vocab) if body.kept_sets else 0,
            # One sample scores the prompt: the samples share it, and asking on all n would
            # compute it n times instead of sharing the prefix cache.
            prompt_logprobs=0 if body.prompt_logprobs and i == 0 else None,
            # Stop strings are matched on text: only they need the detokenizer.
            output_kind=RequestOutputKind.FINAL_ONLY, detokenize=bool(body.stop),
        )
        for attempt in range(2):
            # Checked right before engine.generate, which registers the request before its first
            # suspension: an /abort that ran earlier is seen here, a later one reaches the engine.
            if gen.aborted:
                return GeneratedSample(token_ids=[], logprobs=[], versions=[], finish_reason="abort"), None
            # An adapter request is registered as None: a full reload does not change what version
            # its tokens are.
            self.running[engine_id] = weights.version if weights.switches else None
            try:
                async for out in self.engine.generate(prompt, params, engine_id, lora_request=weights.lora):
                    final = out
            finally:
                del self.running[engine_id]
            # vLLM's renderer (P0) sends a picture's data only when it believes the engine core
            # (P1) caches it; a request rendered and then aborted before it reached the engine
            # (an /abort between the render and engine.generate) leaves P0 believing so, and the
            # next request with that picture ends "error" (vLLM: "P0/P1 cache drift", retryable:
            # it drops the pictures from P0's record). Rendered again, they go with their data.
            if not (body.images and final.outputs[0].finish_reason == "error" and attempt == 0):
                break
            prompt = await self.with_images(body, weights)
        if body.images:
            gen.prompt_token_ids = list(final.prompt_token_ids)
        return self.tagged(engine_id, final, weights, body, params, vocab)

    @staticmethod
    def tagged(engine_id: str, final, weights: WeightsInUse, body: GenerateRequest,
               params, vocab: int) -> tuple[GeneratedSample, list[float | None] | None]:
        """The engine's final output as a sample, each token tagged with its version."""
        c = final.outputs[0]
        if c.finish_reason not in FINISH_REASONS:
            raise HTTPException(500, f"engine request {engine_id} finished with {c.finish_reason}")
        tokens = list(c.token_ids)
        versions = token_versions(len(tokens), weights.version,
                                  getattr(c, "weight_versions", None) if weights.switches else None)
        sample = GeneratedSample(
            token_ids=tokens, logprobs=[c.logprobs[j][t].logprob for j, t in enumerate(tokens)],
            versions=versions, finish_reason=c.finish_reason,
            kept=kept_sets(c.logprobs, params.logprobs, vocab) if body.kept_sets else None,
        )
        prompt_logprobs = None
        if params.prompt_logprobs is not None and final.prompt_logprobs is not None:
            prompt_logprobs = [None if d is None else d[t].logprob
                               for d, t in zip(final.prompt_logprobs, final.prompt_token_ids)]
        return sample, prompt_logprobs

    async def label(self, version: int) -> None:
        """Label the engine's weights as `version` (vLLM's weight version): the engine core tags
        every step's output with the label it holds then. Called by an update while the engine
        is paused; until the first, the engine's label is "default" (token_versions)."""
        await self.engine.update_weight_version(str(version))

    def switch(self) -> int:
        """Count a reload (the prefix cache salt); returns how many requests it switched."""
        self.reloads += 1
        return self.held()

    def held(self) -> int:
        """Our base-weight engine requests in progress (queued in the engine too): those a reload
        switches to the new version."""
        return sum(v is not None for v in self.running.values())


def token_versions(n: int, start: int, spans) -> list[int]:
    """The version of each of a request's n tokens: from the engine's weight-version spans (vLLM
    WeightVersionSpan: label, start, end) where they carry our labels (Generations.label), else
    `start`, the version the request was registered at. Tokens the engine sampled before any label
    of ours (its first label is "default") get `start` too: a tag never newer than the truth,
    which the staleness bound only ever errs safe on."""
    versions = [start] * n
    for span in spans or ():
        try:
            v = int(span.version)
        except ValueError:
            continue
        versions[span.start:span.end] = [v] * (min(span.end, n) - span.start)
    return versions
