"""A trajectory's routed experts, merged across its model turns, for the batch's `routed_experts`
(rl/batch.py) and the trainer's routing replay.

Each /generate answer (routed_experts: true) gives the routing of every position its engine
request ran: the prompt (the whole conversation so far in a multi-turn episode) and the sampled
tokens but the last. A later turn recomputes the earlier positions, possibly with newer weights;
the record that counts for them is the first, the forward that sampled the tokens they predict
(the trainer scores each token from the position before it). New positions are taken from each
answer; positions no answer covers (the last sampled token, environment tokens after the last
turn) stay unrecorded, and replay falls back to the trainer's own routing there.
"""

from __future__ import annotations

import numpy as np

from rl.inference_api import RoutedExperts


class RoutingRecord:
    def __init__(self) -> None:
        self.experts: np.ndarray | None = None  # [positions, layers, top_k]
        self.routed = np.zeros(0, bool)

    def add(self, answer: RoutedExperts) -> None:
        rows = answer.array()
        have = np.ones(len(rows), bool)
        have[[p for p in answer.missing if p < len(rows)]] = False
        if self.experts is None:
            self.experts, self.routed = rows.copy(), have
            return
        if rows.shape[1:] != self.experts.shape[1:]:
            raise ValueError(f"routed experts of shape {list(rows.shape[1:])} after {list(self.experts.shape[1:])}")
        old = len(self.routed)
        if len(rows) > old:
            self.experts = np.concatenate([self.experts, rows[old:]])
            self.routed = np.concatenate([self.routed, have[old:]])
        # Earlier positions keep their first record; only gaps there are filled.
        span = min(old, len(rows))
        gap = ~self.routed[:span] & have[:span]
        self.experts[:span][gap] = rows[:span][gap]
        self.routed[:span] |= gap

    def padded(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(experts [n, layers, top_k], routed [n] uint8) for a trajectory of n tokens."""
        experts = np.zeros((n, *self.experts.shape[1:]), self.experts.dtype)
        routed = np.zeros(n, np.uint8)
        m = min(n, len(self.routed))
        experts[:m], routed[:m] = self.experts[:m], self.routed[:m]
        return experts, routed
