"""The policy-gradient loss family against values worked out by hand with `math`."""

from __future__ import annotations

import math

import pytest
import torch

from rl.config import LossConfig
from trainer.loss import policy_loss, token_logprobs_and_entropy

E = math.exp
INF_LP = -1.0  # inference logprob of every loss token; the trainer's logprob is INF_LP + d


def run(d, adv, weight=None, mask=None, ids=None, ref=None, entropy=None, shape=None, lp=None, ilp=None, **cfg):
    """Runs policy_loss on flat lists; returns (output, d loss / d logprobs as a flat list)."""
    n = len(adv)
    lp = [INF_LP + x for x in d] if lp is None else lp
    ilp = [INF_LP] * n if ilp is None else ilp
    shape = shape or (1, n)

    def t(x, dtype=torch.float32):
        return torch.tensor(x, dtype=dtype).reshape(shape)

    logprobs = t(lp).requires_grad_(True)
    out = policy_loss(
        logprobs, t(ilp), t(adv), t(mask or [1.0] * n), t(weight or [1.0] * n),
        t(ids or [0] * n, torch.int64), LossConfig(**cfg),
        entropy=None if entropy is None else t(entropy), reference_logprobs=None if ref is None else t(ref),
    )
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    return out, grad.reshape(-1).tolist()


# (d, A, per-token loss, d loss / d logp, clipped) with clip_low 0.2 and clip_high 0.28.
PPO_CASES = {
    "inside": (0.1, 1.0, -E(0.1), -E(0.1), 0),
    "above_high_pos_adv": (0.5, 1.0, -1.28, 0.0, 1),
    "below_low_neg_adv": (-0.5, -1.0, 0.8, 0.0, 1),
    "above_high_neg_adv_unclipped": (0.5, -1.0, E(0.5), E(0.5), 0),
    "below_low_pos_adv_unclipped": (-0.5, 1.0, -E(-0.5), -E(-0.5), 0),
}


@pytest.mark.parametrize("case", PPO_CASES.values(), ids=PPO_CASES.keys())
def test_ppo_clip_token(case):
    d, adv, loss, grad, clipped = case
    w = 0.5
    out, g = run([d], [adv], weight=[w], clip_low=0.2, clip_high=0.28)
    assert out.loss.item() == pytest.approx(w * loss, rel=1e-5)
    assert g == pytest.approx([w * grad], rel=1e-5, abs=1e-7)
    assert (out.tokens, out.clipped_tokens, out.masked_tokens) == (1.0, clipped, 0.0)
    assert out.ratio_sum == pytest.approx(E(d), rel=1e-6)
    assert out.mismatch_kl_sum == pytest.approx(E(d) - 1 - d, rel=1e-4, abs=1e-9)
    assert out.kl_sum == 0.0


def test_loss_weight_scales_each_token():
    d, adv, w = [0.1, -0.2], [1.0, 2.0], [0.25, 3.0]
    out, g = run(d, adv, weight=w)
    assert out.loss.item() == pytest.approx(-(w[0] * E(d[0]) * adv[0] + w[1] * E(d[1]) * adv[1]), rel=1e-5)
    assert g == pytest.approx([-w[0] * E(d[0]) * adv[0], -w[1] * E(d[1]) * adv[1]], rel=1e-5)


def test_truncated_is_cap_inactive_and_active():
    d, adv, w, cap = [0.5, 1.0], [2.0, -1.0], [0.5, 2.0], 2.0
    lp = [INF_LP + x for x in d]
    out, g = run(d, adv, weight=w, objective="truncated_is", tis_cap=cap)
    c = [E(0.5), cap]  # e^1 > 2: the second weight is capped
    assert out.loss.item() == pytest.approx(sum(-c[i] * adv[i] * lp[i] * w[i] for i in range(2)), rel=1e-5)
    assert g == pytest.approx([-c[i] * adv[i] * w[i] for i in range(2)], rel=1e-5)
    assert out.clipped_tokens == 1.0
    assert out.ratio_sum == pytest.approx(E(0.5) + E(1.0), rel=1e-6)


@pytest.mark.parametrize("objective", ["ppo_clip", "truncated_is"])
def test_sequence_ratio_is_geometric_mean_and_mask_drops_whole_sample(objective):
    # Padded [2, 4]: sample 5 has 3 tokens (mean d 0.1), sample 2 has 2 (mean d 1.5 -> r 4.48 > 3).
    d = [0.1, 0.3, -0.1, 9.0, 1.0, 2.0, 0.0, -9.0]
    adv = [1.0, 2.0, -1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    mask = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    ids = [5, 5, 5, -1, 2, 2, -1, -1]
    out, g = run(d, adv, mask=mask, ids=ids, shape=(2, 4), objective=objective, ratio_level="sequence",
                 mask_high=3.0)
    r0 = E(0.1)
    if objective == "ppo_clip":  # r0 inside the clip: loss -r0 * sum(A), d r0 / d logp_j = r0 / 3
        assert out.loss.item() == pytest.approx(-r0 * 2.0, rel=1e-5)
        assert g[:3] == pytest.approx([-r0 * 2.0 / 3] * 3, rel=1e-5)
    else:  # the weight is detached: each token's gradient is its own -r0 * A
        lp = [INF_LP + x for x in d[:3]]
        assert out.loss.item() == pytest.approx(sum(-r0 * a * x for a, x in zip(adv, lp)), rel=1e-5)
        assert g[:3] == pytest.approx([-r0 * a for a in adv[:3]], rel=1e-5)
    assert g[3:] == [0.0] * 5
    assert (out.tokens, out.masked_tokens) == (5.0, 2.0)
    assert out.ratio_sum == pytest.approx(3 * r0 + 2 * E(1.5), rel=1e-5)


def test_sequence_ratio_gradient_flows_through_the_mean_when_clipped_tokens_mix():
    # One sample, r = e^0.5 > 1.28: the A > 0 token is clipped, the A < 0 one is not and carries
    # the gradient of r to both tokens' logprobs.
    out, g = run([0.2, 0.8], [1.0, -1.0], ids=[4, 4], ratio_level="sequence")
    r = E(0.5)
    assert out.loss.item() == pytest.approx(-1.28 + r, rel=1e-5)
    assert g == pytest.approx([r / 2, r / 2], rel=1e-5)
    assert out.clipped_tokens == 1.0


def test_token_mask_low_and_high_drop_tokens():
    out, g = run([-1.0, 1.0, 0.0], [1.0, -1.0, 1.0], mask_low=0.5, mask_high=2.0)
    assert out.loss.item() == pytest.approx(-1.0, rel=1e-6)
    assert g == pytest.approx([0.0, 0.0, -1.0])
    assert (out.tokens, out.masked_tokens) == (3.0, 2.0)
    assert out.ratio_sum == pytest.approx(E(-1) + E(1) + 1, rel=1e-6)  # metrics keep dropped tokens
    assert out.mismatch_kl_sum == pytest.approx((E(1) - 2) + (E(-1)), rel=1e-5)


@pytest.mark.parametrize("target", ["inference", "reference"])
def test_kl_penalty_value_and_gradient(target):
    # A = 0 leaves only the penalty; the third token is dropped by mask_high: no penalty, but metric.
    d, coef, w = [0.5, -0.3, 1.0], 0.1, [1.0, 2.0, 1.0]
    lp = [INF_LP + x for x in d]
    ref = [-0.7, -1.5, -2.0]
    t = [INF_LP] * 3 if target == "inference" else ref
    x = [t[i] - lp[i] for i in range(3)]
    k3 = [E(v) - v - 1 for v in x]
    out, g = run(d, [0.0] * 3, weight=w, ref=ref if target == "reference" else None,
                 kl_coef=coef, kl_target=target, mask_high=2.0)
    assert out.loss.item() == pytest.approx(coef * (w[0] * k3[0] + w[1] * k3[1]), rel=1e-5)
    assert g == pytest.approx([coef * w[i] * (1 - E(x[i])) for i in range(2)] + [0.0], rel=1e-5)
    assert out.kl_sum == pytest.approx(sum(k3), rel=1e-5)
    assert out.masked_tokens == 1.0


def test_kl_to_reference_needs_reference_logprobs():
    with pytest.raises(ValueError, match=r"trainer\.loss\.kl_target"):
        run([0.0], [1.0], kl_coef=0.1, kl_target="reference")
    out, _ = run([0.0], [1.0], kl_coef=0.0, kl_target="reference")  # off: nothing needed
    assert out.kl_sum == 0.0


@pytest.mark.parametrize("objective", ["ppo_clip", "truncated_is"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_padding_with_garbage_never_touches_loss_or_gradient(objective, level):
    cfg = dict(objective=objective, ratio_level=level, kl_coef=0.1, mask_low=0.1, mask_high=10.0)
    lp, ilp, adv, ref, ent = [-0.9, -1.2, -0.5], [-1.0, -1.0, -0.7], [1.0, -0.5, 2.0], [-1.1, -0.8, -0.6], [
        0.3, 0.2, 0.1]
    clean, g_clean = run(None, adv, lp=lp, ilp=ilp, ids=[0, 0, 1], ref=ref, entropy=ent, **cfg)
    nan, inf = float("nan"), float("inf")
    # Pads: huge d (60 and -inf inference logprob), nan advantages / reference / entropy, huge weights.
    out, g = run(None, adv + [nan, nan], lp=lp + [59.0, -1.0], ilp=ilp + [-1.0, -inf], mask=[1.0, 1.0, 1.0, 0.0, 0.0],
                 weight=[1.0] * 3 + [1e30, inf], ids=[0, 0, 1, -1, 7], ref=ref + [nan, nan],
                 entropy=ent + [nan, inf], **cfg)
    assert math.isfinite(out.loss.item()) and out.loss.item() == pytest.approx(clean.loss.item(), rel=1e-6)
    assert g == pytest.approx(g_clean + [0.0, 0.0], rel=1e-6)
    for k in ("tokens", "masked_tokens", "clipped_tokens", "ratio_sum", "mismatch_kl_sum", "entropy_sum", "kl_sum"):
        assert getattr(out, k) == pytest.approx(getattr(clean, k), rel=1e-6), k
    assert out.entropy_sum == pytest.approx(0.6, rel=1e-6)


@pytest.mark.parametrize("d", [100.0, -100.0])
def test_huge_log_ratio_on_a_loss_token_stays_finite(d):
    out, g = run([d, 0.0], [-1.0, 1.0])
    assert math.isfinite(out.loss.item()) and all(math.isfinite(x) for x in g)
    assert math.isfinite(out.ratio_sum) and math.isfinite(out.mismatch_kl_sum)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_entropy_match_hand_softmax(dtype, per_token):
    """One temperature for all, or one per predicted token (a packed row holding samples drawn
    at different temperatures)."""
    rows, temps = [[1.0, 2.0, 3.0], [0.0, -1.0, 2.0], [5.0, 0.0, 0.0]], [2.0, 0.5] if per_token else [2.0, 2.0]
    tokens = torch.tensor([[0, 2, 1]])
    logits = torch.tensor([rows], dtype=dtype, requires_grad=True)  # values exact in bfloat16
    logprobs, entropy = token_logprobs_and_entropy(logits, tokens, torch.tensor([temps]) if per_token else 2.0)
    want_lp, want_ent = [], []
    for row, tok, temp in zip(rows[:2], [2, 1], temps):  # logits[:, t] predicts tokens[:, t+1]
        z = [x / temp for x in row]
        lse = math.log(sum(E(x) for x in z))
        logp = [x - lse for x in z]
        want_lp.append(logp[tok])
        want_ent.append(-sum(E(x) * x for x in logp))
    assert logprobs.dtype == entropy.dtype == torch.float32 and logprobs.shape == (1, 2)
    assert logprobs[0].tolist() == pytest.approx(want_lp, rel=1e-6)
    assert entropy[0].tolist() == pytest.approx(want_ent, rel=1e-6)
    assert logprobs.requires_grad and not entropy.requires_grad


def test_per_token_temperature_must_cover_every_predicted_token():
    """A [1, 1] (or [R, 1]) temperature would broadcast and scale every token alike: refused."""
    logits, tokens = torch.zeros(2, 4, 5), torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"temperature \[1, 1\], expected one per predicted token \[2, 3\]"):
        token_logprobs_and_entropy(logits, tokens, torch.ones(1, 1))
    assert token_logprobs_and_entropy(logits, tokens, torch.ones(2, 3))[0].shape == (2, 3)
