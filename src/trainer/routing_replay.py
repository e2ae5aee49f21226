"""Routing replay for mixture-of-experts models (trainer.mismatch.routing_replay): each MoE layer sends
each token to the experts the inference engine sent it to, as recorded with the batch
(inference.record_routing, rl/batch.py), instead of the ones the trainer's router picks.

Why: the engine and the trainer compute the router's logits with different kernels, so near-ties
between experts flip, and with a policy version or more between sampling and training the router
itself has moved. Each flip changes the token's whole forward from there on; the importance ratios
of a GRPO step then measure routing noise, and on large MoE models training collapses (R3,
arXiv:2510.11370). Replaying the engine's choice removes that term. The router still learns: the
mixing weights are its softmax at the replayed experts (renormalised over them where the model
does, norm_topk_prob), so the gradient reaches the router logits of the chosen experts, as in R3.

Where a position has no record (padding, a prompt token the engine served from cache, the last
sampled token) the router's own choice stands. Whether replay is on or off, each step reports how
often the trainer's own top-k is the engine's, per layer (routing_agreement): the size of what
replay removes.

Hooks on the routers (transformers' `*TopKRouter` modules: (logits, weights, experts) out): a
forward hook may replace that output, which leaves the experts' modules and their kernels alone.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager, nullcontext

import torch

log = logging.getLogger("trainer")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
WARN_EVERY = 100  # steps between two warnings about tokens replay had no record for


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every MoE layer, in layer order: modules with a router's
    attributes (top_k, num_experts, a weight [experts, hidden]) named "...layers.N....gate"."""
    found = []
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if (match and name.endswith(".gate") and hasattr(module, "top_k") and hasattr(module, "num_experts")
                and isinstance(getattr(module, "weight", None), torch.Tensor)):
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda x: x[0])


class RoutingReplay:
    """Installed once on the model; `recorded(mb)` around a micro-batch's forward and backward
    (activation checkpointing re-runs the forward, hooks included, in backward)."""

    def __init__(self, model: torch.nn.Module, replay: bool):
        self.replay = replay
        self.routers = routers(model)
        self.layers = [layer for layer, _ in self.routers]
        self.current: tuple[torch.Tensor, torch.Tensor] | None = None
        self.counting = False
        self.warned_at = -WARN_EVERY
        # Per layer: positions where the router's own top-k is the recorded one; then positions
        # recorded, trained positions replayed, trained positions.
        self.sums = torch.zeros(len(self.routers) + 3, dtype=torch.float64)
        self.handles = [router.register_forward_hook(self._hook(i)) for i, (_, router) in enumerate(self.routers)]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()

    @contextmanager
    def recorded(self, routing: torch.Tensor | None, routed: torch.Tensor | None, trained: torch.Tensor):
        """routing [R, T, layers, top_k] and routed [R, T] (None: no record); trained [R, T] bool:
        the positions that predict a trained token (what replayed_frac is the share of)."""
        if routing is not None and routing.shape[2] != len(self.routers):
            raise ValueError(f"the batch records routing for {routing.shape[2]} MoE layers, the model has "
                             f"{len(self.routers)} (layers {self.layers}): was it sampled from another model?")
        device = self.routers[0][1].weight.device
        if routing is None:
            routing = torch.zeros((*trained.shape, len(self.routers), 1), dtype=torch.long)
            routed = torch.zeros(trained.shape, dtype=torch.bool)
        self.current = (routing.reshape(-1, *routing.shape[2:]).to(device), routed.reshape(-1).to(device))
        self.sums[-2] += float((routed & trained).sum()) if self.replay else 0.0
        self.sums[-1] += float(trained.sum())
        # Agreement is counted on the forward only: activation checkpointing re-runs it in backward.
        self.counting = True
        try:
            yield
        finally:
            self.current = None

    def end_forward(self) -> None:
        """The micro-batch's forward is done: a re-run in backward counts nothing again."""
        self.counting = False

    def _hook(self, i: int):
        def hook(module, args, out):
            if self.current is None:
                return None
            logits, weights, own = out
            recorded, routed = self.current
            recorded = recorded[:, i].to(own.dtype)
            if self.counting:
                with torch.no_grad():
                    same = (own.sort(-1).values == recorded.sort(-1).values).all(-1) & routed
                    self.sums[i] += float(same.sum())
                    if i == 0:
                        self.sums[-3] += float(routed.sum())
            if not self.replay:
                return None
            chosen = torch.where(routed[:, None], recorded, own)
            # In float32 at least, as transformers' routers compute it (float64 stays float64).
            probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", False):
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(weights.dtype), chosen

        return hook

    def take_sums(self) -> torch.Tensor:
        """This rank's counts since the last call (per layer agreeing positions, routed positions,
        replayed and trained positions), for the step's all-reduce; then zero."""
        out, self.sums = self.sums, torch.zeros_like(self.sums)
        return out

    def metrics(self, sums: list[float]) -> dict:
        """The step's metrics from the counts summed over ranks: none for a step whose batch
        carried no routing (rl sft, a server not recording), but the replayed share when replay
        was asked for."""
        *agree, counted, replayed, trained = sums
        out = {"routing_replayed_frac": replayed / max(trained, 1.0)} if self.replay else {}
        if counted:
            out.update({f"routing_agreement/layer_{layer}": a / counted for layer, a in zip(self.layers, agree)})
            out["routing_agreement"] = sum(agree) / (counted * len(agree))
        return out

    def warn_unrecorded(self, step: int, record: dict) -> None:
        """With replay on, a step some of whose trained tokens fell back to the router's own
        choice (no record at their position) is said, at most once every WARN_EVERY steps."""
        share = record.get("routing_replayed_frac", 1.0)
        if self.replay and share < 1.0 and step >= self.warned_at + WARN_EVERY:
            self.warned_at = step
            log.warning("step %d: %.1f%% of the trained tokens had no recorded routing and were routed by the "
                        "trainer itself (routing_replayed_frac %.3f): the engine records only what it computes "
                        "(prefix caching must stay off; inference.record_routing on every server)",
                        step, 100 * (1 - share), share)


class NoRouting:
    """A dense model's routing: nothing to record, count or replay. The trainer's step calls it as
    it calls RoutingReplay, without asking which model it trains."""

    def recorded(self, routing: torch.Tensor | None, routed: torch.Tensor | None, trained: torch.Tensor):
        return nullcontext()

    def end_forward(self) -> None:
        pass

    def take_sums(self) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def metrics(self, sums: list[float]) -> dict:
        return {}

    def warn_unrecorded(self, step: int, record: dict) -> None:
        pass


def routing_for(model: torch.nn.Module, replay: bool) -> RoutingReplay | NoRouting:
    """The model's routing, chosen once: replayed and counted for an MoE model, nothing for a dense one."""
    return RoutingReplay(model, replay) if routers(model) else NoRouting()
