"""One request's or trajectory's routed experts: [positions, layers, top_k] expert ids and which
positions have a row, where the first row a position gets stays. The engine's recorder fills it
forward by forward (inference/routing_capture.py: a preempted request recomputes positions it had
processed); a trajectory fills it answer by answer (orchestrator/rollout/kind.py: a later turn's
request recomputes the earlier turns, and the row that counts is the forward that sampled from
them). The wire form is rl.inference_api.RoutedExperts.
"""

from __future__ import annotations

import base64

import numpy as np

from rl.inference_api import RoutedExperts


class RoutingRows:
    def __init__(self, layers: int, top_k: int, dtype):
        self.experts = np.zeros((64, layers, top_k), dtype)
        self.seen = np.zeros(64, bool)

    @classmethod
    def like(cls, answer: RoutedExperts) -> RoutingRows:
        """Empty rows of an answer's [layers, top_k] and dtype."""
        return cls(len(answer.layers), answer.top_k, answer.dtype)

    def put(self, positions: np.ndarray, experts: np.ndarray) -> None:
        """Rows for these positions; a position that already has one keeps it."""
        if not len(positions):
            return
        need = int(positions.max()) + 1
        if need > len(self.seen):
            size = max(need, 2 * len(self.seen))
            grown = np.zeros((size, *self.experts.shape[1:]), self.experts.dtype)
            grown[:len(self.seen)] = self.experts
            self.experts = grown
            self.seen = np.concatenate([self.seen, np.zeros(size - len(self.seen), bool)])
        new = ~self.seen[positions]
        self.experts[positions[new]] = experts[new]
        self.seen[positions[new]] = True

    def add(self, answer: RoutedExperts) -> None:
        """An answer's rows (all its positions but the missing ones)."""
        rows = answer.array()
        have = np.ones(len(rows), bool)
        have[[p for p in answer.missing if p < len(rows)]] = False
        self.put(np.flatnonzero(have), rows[have])

    def encoded(self) -> dict:
        """RoutedExperts' positions, data and missing: the rows up to the last position seen,
        base64 of the row-major array, and the positions before it that lack one."""
        n = int(np.flatnonzero(self.seen)[-1]) + 1 if self.seen.any() else 0
        return {"positions": n, "data": base64.b64encode(self.experts[:n].tobytes()).decode(),
                "missing": np.flatnonzero(~self.seen[:n]).tolist()}

    def padded(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(experts [n, layers, top_k], routed [n] uint8) for a trajectory of n tokens."""
        experts = np.zeros((n, *self.experts.shape[1:]), self.experts.dtype)
        routed = np.zeros(n, np.uint8)
        m = min(n, len(self.seen))
        experts[:m], routed[:m] = self.experts[:m], self.seen[:m]
        return experts, routed
