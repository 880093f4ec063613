"""Group baselines by hand."""
import numpy as np
import pytest

from stablerl_jax import advantages as adv


def test_group_mean_by_hand():
    np.testing.assert_allclose(adv.group_mean([1, 0, 0, 1, 1, 1], 3),
                               [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], rtol=1e-6, atol=1e-7)


def test_group_norm_by_hand_and_zero_variance_group():
    a = adv.group_norm([1, 0, 1, 1], 2)  # group 0: mean .5, std .5; group 1: std 0
    np.testing.assert_allclose(a, [1, -1, 0, 0], rtol=1e-5)
    assert np.isfinite(a).all()


def test_leave_one_out_by_hand():
    # R = [1, 0, 0]: Â_0 = 1 − 0 = 1, Â_1 = 0 − 1/2 = −1/2.
    np.testing.assert_allclose(adv.leave_one_out([1, 0, 0], 3), [1, -0.5, -0.5], rtol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="group_size=3"):
        adv.group_mean([1, 0], 3)
    with pytest.raises(ValueError, match="group_size=1"):
        adv.leave_one_out([1, 0], 1)
