"""The policy-gradient loss family: PPO clip or truncated importance sampling, per token or per
sequence, with optional ratio masking and a k3 KL penalty (configured by `rl.config.LossConfig`).

Every ratio is pi_trainer(token) / pi_inference(token), where pi_inference is what the engine
reported while sampling. That one ratio covers both off-policy staleness (the sample came from an
older version) and the numeric mismatch between the engine and the trainer, so no extra forward
pass of an "old" policy is needed (as in PipelineRL and PRIME-RL).

Normalisation is not done here: the caller's per-token `loss_weight` already encodes it, so the
loss is a plain weighted sum and micro-batches and ranks add up to the batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl.config import LossConfig
from trainer.sampling_mask import NO_TRUNCATION, NoTruncation, Truncation

# exp(20) ~ 5e8 is far beyond any clip, cap or mask threshold, so clamping the log-ratio there
# changes no decision; it keeps exp() finite (no inf * 0 = nan in the loss or its gradient).
_MAX_LOG_RATIO = 20.0


# The metrics policy_loss sums, in LossOutput.stats' order:
STATS = (
    "tokens",  # loss tokens (loss_mask == 1)
    "masked_tokens",  # loss tokens dropped by mask_low / mask_high
    "clipped_tokens",  # ppo_clip: gradient zeroed by the clip; truncated_is: ratio > tis_cap
    "ratio_sum",  # token or sequence ratio, summed over loss tokens
    "mismatch_kl_sum",  # k3 estimate of KL(pi_inference || pi_trainer), summed over loss tokens
    "entropy_sum",  # 0.0 without entropy
    "kl_sum",  # k3 value of the KL penalty (without kl_coef); 0.0 when kl_coef == 0
)


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable: sum of loss_weight * per-token loss over kept tokens
    # float32 [len(STATS)] on the loss's device: the trainer sums them there over a step's
    # micro-batches and reads them once (reading one per micro-batch would wait for the device).
    stats: Tensor

    def __getattr__(self, name: str) -> float:
        if name in STATS:  # out.tokens etc.: one value, read now
            return float(self.stats[STATS.index(name)])
        raise AttributeError(name)


def token_logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float | Tensor,
                               truncation: Truncation | NoTruncation = NO_TRUNCATION,
                               smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """logits [R, T, V] (any float dtype), tokens [R, T] int64, temperature a number or one per
    predicted token ([R, T-1], as MicroBatch.temperature: samples of one batch may be sampled at
    different temperatures). Returns (logprobs, entropy), both float32 [R, T-1]: the logprob of
    tokens[:, t+1] under logits[:, t] / temperature[:, t] (the distribution the engine sampled
    from) and that distribution's entropy (detached, metrics only). With `truncation`, its
    selected positions are renormalised over the kept set instead (trainer/sampling_mask.py:
    the sampler's own where truncation.kept has it), truncation.misses counts sampled tokens the
    set lacked and truncation.replayed the positions with a replayed set. `smoothing` (rl sft's
    label smoothing, never with truncation) returns (1 - s) * logprob + s * the mean logprob over
    the vocabulary instead: minus it is torch's cross_entropy(..., label_smoothing=s)."""
    if isinstance(temperature, Tensor):
        if temperature.shape != tokens[:, 1:].shape:
            # [1, 1] or [R, 1] would broadcast silently and scale every token alike.
            raise ValueError(f"temperature {list(temperature.shape)}, expected one per predicted token "
                             f"{list(tokens[:, 1:].shape)}")
        temperature = temperature.to(device=logits.device, dtype=torch.float32)[..., None]
    scaled = logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    logprobs = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    if smoothing:
        logprobs = (1 - smoothing) * logprobs + smoothing * logp_all.mean(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    logprobs, entropy, counts = truncation.renormalise(scaled, tokens[:, 1:], logprobs, entropy)
    truncation.counted(counts)
    return logprobs, entropy


def _sequence_mean(x: Tensor, mask: Tensor, sequence_ids: Tensor) -> Tensor:
    """Mean of x over each sample's loss tokens, broadcast back to its tokens (0 off the mask)."""
    # Ids are arbitrary (sparse, unsorted, -1 on padding): compact them so the segment buffers
    # are as small as the number of samples in the micro-batch.
    ids = torch.where(mask, sequence_ids, torch.full_like(sequence_ids, -1))
    uniq, seg = torch.unique(ids, return_inverse=True)
    n = uniq.numel()
    sums = x.new_zeros(n).index_add(0, seg, torch.where(mask, x, 0.0))
    counts = x.new_zeros(n).index_add(0, seg, mask.float())
    return torch.where(mask, (sums / counts.clamp(min=1))[seg], 0.0)


def _k3(x: Tensor) -> Tensor:
    """k3 estimator exp(x) - x - 1 of KL(p || q) for x = log q - log p, sampled from p: unbiased,
    non-negative, lower variance than -x."""
    return torch.exp(x) - x - 1


def policy_loss(
    logprobs: Tensor,
    inference_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    loss_weight: Tensor,
    sequence_ids: Tensor,
    cfg: LossConfig,
    entropy: Tensor | None = None,
    reference_logprobs: Tensor | None = None,
) -> LossOutput:
    """All tensors share one shape ([1, L-1] packed or [B, T-1] padded) and are treated as flat;
    tokens with loss_mask 0 may hold any values and never touch the loss or its gradient."""
    if cfg.kl_coef > 0 and cfg.kl_target == "reference" and reference_logprobs is None:
        raise ValueError("trainer.loss.kl_target = 'reference' with kl_coef > 0 needs reference_logprobs")
    mask = loss_mask.reshape(-1) > 0

    def clean(x: Tensor) -> Tensor:
        # Padding may hold garbage (inf, nan); where() also gives it an exact zero gradient.
        return torch.where(mask, x.reshape(-1).float(), 0.0)

    logp, adv, weight = clean(logprobs), clean(advantages), clean(loss_weight)
    d = (logp - clean(inference_logprobs)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if cfg.ratio_level == "sequence":
        # GSPO: the geometric mean of the sample's token ratios, differentiable through the mean.
        log_ratio = _sequence_mean(d, mask, sequence_ids.reshape(-1))
    else:
        log_ratio = d
    ratio = torch.exp(log_ratio)

    if cfg.objective == "ppo_clip":
        unclipped = ratio * adv
        clipped_obj = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped_obj)
        clipped = clipped_obj.detach() < unclipped.detach()
    else:
        # CISPO-style: the capped weight is a constant, so every token keeps its logprob gradient.
        per_token = -ratio.detach().clamp(max=cfg.tis_cap) * adv * logp
        clipped = ratio.detach() > cfg.tis_cap

    keep = mask.clone()
    r = ratio.detach()
    if cfg.mask_low is not None:
        keep &= r >= cfg.mask_low
    if cfg.mask_high is not None:
        keep &= r <= cfg.mask_high

    kl = torch.zeros_like(logp)
    if cfg.kl_coef > 0:
        if cfg.kl_target == "reference":
            # Penalty towards a target, gradient through logp only: KL(pi_trainer || target).
            log_target_ratio = (clean(reference_logprobs) - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        else:
            log_target_ratio = -d
        kl = _k3(log_target_ratio)
        per_token = per_token + cfg.kl_coef * kl

    loss = torch.where(keep, weight * per_token, 0.0).sum()

    with torch.no_grad():
        dd = d.detach()
        # The tokens were sampled from pi_inference, so k3 with x = log pi_trainer - log pi_inference.
        mismatch_kl = _k3(dd)
        ent = clean(entropy.detach()) if entropy is not None else torch.zeros_like(dd)
        stats = torch.stack([
            mask.sum().float(),
            (mask & ~keep).sum().float(),
            (mask & clipped).sum().float(),
            torch.where(mask, r, 0.0).sum(),
            torch.where(mask, mismatch_kl, 0.0).sum(),
            ent.sum(),
            torch.where(mask, kl.detach(), 0.0).sum(),
        ])
    return LossOutput(loss, stats)
