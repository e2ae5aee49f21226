"""Math answers checked with math-verify (`reward = "math_verify"`): the completion's final
answer (a \\boxed{} one first, else the last expression math-verify finds) against the row's
reference answer, compared as mathematical objects (1/2 = 0.5 = \\frac{1}{2}).

Components: `correct` (1 or 0) and `boxed` (1 if the completion boxed an answer). `boxed` weighs
0 (reward.weights, the defaults a dataset's reward_weights overrides): logged to show whether
the model follows the format, rewarded only if a config says so, e.g. {boxed = 0.1}.

math-verify's own timeouts use SIGALRM, which only the main thread may set; rewards run in
worker threads (orchestrator/rewards/reward.py), whose timeout (orchestrator.timeouts.reward_s) applies
instead.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

# It warns at every call that its timeout is off; ours is on (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

def reward(prompt: str, completion: str, row: dict) -> dict[str, float]:
    gold = parse(str(row["answer"]), parsing_timeout=None)
    answer = parse(completion, parsing_timeout=None)
    correct = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
    return {"correct": float(correct), "boxed": float("\\boxed" in completion)}


reward.weights = {"boxed": 0.0}
