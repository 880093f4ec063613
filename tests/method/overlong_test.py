"""Over-long responses: DAPO's soft length penalty by hand, the response-length monitors,
and rl.overlong=mask: a truncated row adds nothing to the loss, its gradient or its
denominators, after advantages over the whole group."""
import jax
import numpy as np
import pytest
from rl_helpers import tiny_cfg
from step_helpers import REWARDS, step_rollout64
from tolerance import assert_close, backward_chain

from stablerl_jax.config import LossConfig
from stablerl_jax.method import overlong
from stablerl_jax.rl import step_fns


def test_length_penalty_by_hand():
    # N = 10, L_buf = 4: free up to 6 tokens, then (6 − |y|)/4: 7 → −1/4, 8 → −1/2,
    # 9 → −3/4, 10 → −1; times the factor.
    lengths = [1, 6, 7, 8, 9, 10]
    np.testing.assert_array_equal(overlong.length_penalty(lengths, 10, 4),
                                  np.float32([0, 0, -0.25, -0.5, -0.75, -1.0]))
    np.testing.assert_array_equal(overlong.length_penalty(lengths, 10, 4, factor=0.5),
                                  np.float32([0, 0, -0.125, -0.25, -0.375, -0.5]))
    # L_buf = N: the ramp starts at the first token (1 → −0.1).
    np.testing.assert_array_equal(overlong.length_penalty([1, 10], 10, 10),
                                  np.float32([-0.1, -1.0]))
    with pytest.raises(ValueError, match="rl.overlong_buffer"):
        overlong.length_penalty(lengths, 10, 0)


def test_response_stats_by_hand():
    # Lengths 3, 10, 10 of N = 10, the second ends on a stop id: one truncated of three,
    # two clipped at N.
    stats = overlong.response_stats([3, 10, 10], [False, False, True], 10)
    assert stats == {"response/length_mean": 23 / 3, "response/length_max": 10.0,
                     "response/length_min": 3.0, "response/truncated_frac": 1 / 3,
                     "response/clip_ratio": 2 / 3}


def test_masked_truncated_rows_leave_the_loss(x64):
    """Rows 1 and 4 truncated, rl.overlong=mask: advantages are those of `keep` (computed
    over every row), the truncated rows' mask is 0, and the loss and its gradient equal
    those of the six other rows alone (float64: only summation order differs)."""
    cfg, params, ro, model = step_rollout64()
    truncated = np.zeros(8, bool)
    truncated[[1, 4]] = True
    ro = ro._replace(truncated_B=jax.numpy.asarray(truncated))
    loss_cfg = LossConfig()  # MiniRL's response_sum: 1/B' counts the rows with a token
    make = lambda mode: tiny_cfg(num_minibatches=1, overlong=mode).replace(model=model,
                                                                          loss=loss_cfg)
    masked_cfg, keep_cfg = make("mask"), make("keep")
    masked, _ = step_fns.score(params, ro, REWARDS, cfg=masked_cfg)
    kept, _ = step_fns.score(params, ro, REWARDS, cfg=keep_cfg)
    np.testing.assert_array_equal(masked.advantages_B, kept.advantages_B)
    assert float(np.abs(np.asarray(kept.advantages_B)[[1, 4]]).sum()) > 0  # they mattered
    np.testing.assert_array_equal(np.asarray(masked.mask_BxT)[truncated], 0.0)
    np.testing.assert_array_equal(np.asarray(masked.mask_BxT)[~truncated],
                                  np.asarray(kept.mask_BxT)[~truncated])
    keep = np.flatnonzero(~truncated)
    others = jax.tree.map(lambda x: None if x is None else x[keep], kept)

    loss = jax.jit(jax.value_and_grad(lambda p, b: step_fns.rl_loss(p, b, cfg=masked_cfg)[0]))
    v_masked, g_masked = loss(params, masked)
    v_others, g_others = loss(params, others)
    s = ro.tokens_BxS.shape[1]
    tokens = int(np.asarray(ro.prompt_mask_BxS | ro.completion_mask_BxS).sum())
    n = backward_chain(model, s, tokens)
    assert_close(v_masked, v_others, n=n, dtype="float64", scale=1.0)
    for a, b in zip(jax.tree.leaves(g_masked), jax.tree.leaves(g_others)):
        assert_close(a, b, n=n, dtype="float64", scale="max")
