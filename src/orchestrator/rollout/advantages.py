"""Group-relative advantages (GRPO): each completion is scored against its siblings, so no value
model is needed."""

from __future__ import annotations

import statistics


def group_advantages(rewards: list[float], normalize: bool) -> list[float]:
    """reward - group mean; divided by the group's std when `normalize` (GRPO), left unscaled
    otherwise (Dr. GRPO: the std division over-weights near-uniform groups). A group whose
    rewards are all equal gets zero advantages: it carries no signal."""
    mean = statistics.fmean(rewards)
    centred = [r - mean for r in rewards]
    if not normalize:
        return centred
    std = statistics.pstdev(rewards)
    return [c / (std + 1e-6) for c in centred]
