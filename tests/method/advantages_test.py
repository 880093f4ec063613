"""Group baselines by hand."""
import jax
import numpy as np
import pytest
from tolerance import assert_close

from stablerl_jax.method import advantages as adv

# Rewards are exact; a group mean over G ≤ 4 values is a sum (G − 1 roundings) and a
# division (1), the centring a subtraction (1): n = 5. Exact zeros stay exactly zero.
N = 5


def test_group_mean_by_hand():
    # R is exact, so the mean's roundings count relative to the result:
    # cond = |mean| / |R − mean| ≤ (2/3) / (1/3).
    assert_close(adv.group_mean([1, 0, 0, 1, 1, 1], 3), [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], n=N,
                 cond=2.0)


def test_group_norm_by_hand_and_zero_variance_group():
    a = adv.group_norm([1, 0, 1, 1], 2)  # group 0: mean .5, std .5; group 1: std 0
    # The std adds a sum of squares, a division and a sqrt (4), the normalization 2 more
    # (eps = 1e-6 against std 0.5 moves the result by 2e-6 relative: a 1e-6-sized
    # modelling term, far above rounding, so it is part of the expected value). |mean| =
    # |R − mean| and the sum of squares has no cancellation: cond 1.
    assert_close(a, np.array([1, -1, 0, 0]) * 0.5 / (0.5 + 1e-6), n=N + 6)
    # Sample std (ddof=1) of [1, 0] is 1/√2.
    want = np.array([0.5, -0.5]) / (0.5**0.5 + 1e-6)
    assert_close(adv.group_norm([1, 0], 2, ddof=1), want, n=N + 6)


def test_compute_passes_the_std_ddof_to_group_norm_only():
    r = [1, 0, 0, 0]
    assert_close(adv.compute("group_norm", r, 4, std_ddof=1), adv.group_norm(r, 4, ddof=1), n=0)
    assert_close(adv.compute("group_norm", r, 4), adv.group_norm(r, 4), n=0)
    # Sample vs population std at G = 4: the advantages differ by √((G−1)/G).
    assert_close(adv.compute("group_norm", r, 4, std_ddof=1),
                 np.asarray(adv.group_norm(r, 4)) * (3 / 4) ** 0.5, n=N + 6)
    assert_close(adv.compute("group_mean", r, 4, std_ddof=1), adv.group_mean(r, 4), n=0)


def test_equal_rewards_give_exactly_zero():
    # 0.1 is not exact in binary: R − mean would be ±1 ulp, and /(std + eps) would blow it up.
    r = np.full(6, 0.1, np.float32)
    for fn in adv.ADVANTAGES.values():
        out = fn(r, 3)
        assert np.all(np.asarray(out) == 0.0), fn.__name__


def test_leave_one_out_by_hand():
    # R = [1, 0, 0]: Â_0 = 1 − 0 = 1, Â_1 = 0 − 1/2 = −1/2. The group mean, then the
    # factor G/(G − 1) (2); |mean| = 1/3 ≤ |R − mean|: cond 1.
    assert_close(adv.leave_one_out([1, 0, 0], 3), [1, -0.5, -0.5], n=N + 2)


def test_groups_are_consecutive_and_jit():
    r = np.array([1.0, 0.0, 3.0, 1.0])
    f = jax.jit(adv.group_mean, static_argnums=1)
    # Dyadic rewards and means: exact here; cond = |mean| / |R − mean| ≤ 2 and 1.25 / 0.25.
    assert_close(f(r, 2), [0.5, -0.5, 1.0, -1.0], n=N, cond=2.0)
    assert_close(adv.group_mean(r, np.int64(4)), r - 1.25, n=N, cond=5.0)


def test_errors():
    with pytest.raises(ValueError, match="group_size=3"):
        adv.group_mean([1, 0], 3)
    with pytest.raises(ValueError, match="group_size=1"):
        adv.leave_one_out([1, 0], 1)
    with pytest.raises(ValueError, match="group_size"):
        adv.group_mean([1, 0], 0)
    with pytest.raises(ValueError, match="ddof"):
        adv.group_norm([1], 1, ddof=1)
