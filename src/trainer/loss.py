"""The policy-gradient loss: PPO-style clipped importance ratio against the inference logprobs.

The ratio is pi_theta(token) / pi_infer(token), where pi_infer is what vLLM reported while
sampling. That one ratio covers both off-policy staleness (the sample came from an older
version) and the numeric mismatch between the engine and the trainer, so no extra forward pass
of an "old" policy is needed (as in PipelineRL and PRIME-RL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss_sum: torch.Tensor  # summed over loss tokens; normalised by the caller
    clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor
    mismatch_kl_sum: torch.Tensor


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logprob of tokens[:, t+1] under logits[:, t], float32, shape [B, T-1]."""
    logits = logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def clipped_pg_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> LossOutput:
    """All inputs [B, T] aligned on the predicted token (advantages per token)."""
    log_ratio = (logprobs - inference_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        was_clipped = (clipped < unclipped) & mask.bool()
        # k3 estimator of KL(pi_infer || pi_theta): non-negative, low variance.
        kl = (torch.exp(-log_ratio) - 1 + log_ratio) * mask
    return LossOutput(
        loss_sum=(per_token * mask).sum(),
        clipped_tokens=was_clipped.sum(),
        ratio_sum=(ratio * mask).sum().detach(),
        mismatch_kl_sum=kl.sum(),
    )
