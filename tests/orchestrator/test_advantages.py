from __future__ import annotations

import pytest

from orchestrator.rollout.advantages import group_advantages


def test_centred_advantages_sum_to_zero_and_rank_like_rewards():
    adv = group_advantages([0.0, 0.5, 1.0, 0.5], normalize=False)
    assert adv == pytest.approx([-0.5, 0.0, 0.5, 0.0])


def test_normalized_advantages_have_unit_std():
    adv = group_advantages([0.0, 1.0], normalize=True)
    assert adv == pytest.approx([-1.0, 1.0], abs=1e-4)


def test_equal_rewards_give_zero_advantage():
    assert group_advantages([0.3] * 4, normalize=True) == pytest.approx([0.0] * 4)
    assert group_advantages([0.3] * 4, normalize=False) == pytest.approx([0.0] * 4)
