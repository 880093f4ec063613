"""The losses on awkward inputs: non-finite or masked values, degenerate and numpy batches,
mini-batch metric sums, bad batches and config errors naming their field."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_helpers import BATCH, LOGP, vg
from tolerance import assert_close

from stablerl_jax.config import LOSS_NAMES, ConfigError, LossConfig
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.method import losses
from stablerl_jax.method.losses import LossBatch


def test_non_finite_old_logp_on_a_real_token_makes_the_loss_nan():
    # NaN π_old on a counted token: NaN comparisons are False, so the clip mask would keep
    # the token; the loss is NaN instead and the trainer skips the update.
    for name in losses.LOSSES:
        for field in ("old_logp_BxT", "rollout_logp_BxT"):
            bad = BATCH._replace(**{field: getattr(BATCH, field).at[0, 0].set(jnp.nan)})
            (v, _), _ = vg(name, LossConfig(name=name), LOGP, bad)
            assert np.isnan(v), (name, field)
        bad = BATCH._replace(advantages_B=BATCH.advantages_B.at[1].set(jnp.inf))
        assert np.isnan(vg(name, LossConfig(name=name), LOGP, bad)[0][0]), name


def test_minibatch_metrics_reduce_to_the_full_batch(x64):
    # Algebra of the (num, den) pairs, so float64: two halves reduce to the whole batch.
    rng = np.random.default_rng(1)
    logp = jnp.asarray(-rng.uniform(0.1, 3.0, (8, 5)))
    batch = LossBatch(old_logp_BxT=logp + 0.3 * rng.normal(size=(8, 5)),
                      rollout_logp_BxT=logp + 0.3 * rng.normal(size=(8, 5)),
                      mask_BxT=jnp.asarray(rng.uniform(size=(8, 5)) > 0.3),
                      advantages_B=jnp.array([1.0, -1, 0.5, -0.5, 2, -2, 0, 1]))
    loss = jax.jit(losses.minirl, static_argnums=2)
    cfg = LossConfig()
    full = dg.reduce_metrics([loss(logp, batch, cfg)[1]])
    halves = [loss(logp[s], jax.tree.map(lambda v: v[s], batch), cfg)[1]
              for s in (slice(0, 4), slice(4, 8))]
    parts = dg.reduce_metrics(halves)
    assert set(full) == set(parts)
    # Sums of ≤ 40 terms of both signs, each ≤ 400 in size (a squared clipped log-ratio).
    for key in full:  # "loss" too: response_sum over equal halves is the mean of the halves
        assert_close(parts[key], full[key], n=48, dtype="float64", scale=400.0, err_msg=key)


def test_masked_tokens_contribute_nothing():
    # Padding slot (1, 1) holding −inf / NaN / absurd values changes neither value nor gradient.
    logp2 = LOGP.at[1, 1].set(-jnp.inf)
    batch2 = BATCH._replace(rollout_logp_BxT=BATCH.rollout_logp_BxT.at[1, 1].set(jnp.nan),
                  old_logp_BxT=BATCH.old_logp_BxT.at[1, 1].set(1e9))
    for name in losses.LOSSES:
        cfg = LossConfig(name=name)
        (v1, m1), g1 = vg(name, cfg, LOGP, BATCH)
        (v2, m2), g2 = vg(name, cfg, logp2, batch2)
        # The padding slot is masked out before any arithmetic: bit for bit the same.
        np.testing.assert_array_equal(v2, v1, err_msg=name)
        np.testing.assert_array_equal(g2, g1, err_msg=name)
        assert float(g2[1, 1]) == 0.0
        r1, r2 = dg.reduce_metrics([m1]), dg.reduce_metrics([m2])
        for key in r1:
            np.testing.assert_array_equal(r2[key], r1[key], err_msg=f"{name} {key}")


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_degenerate_batches_are_finite(name):
    cases = {
        "equal rewards": BATCH._replace(advantages_B=jnp.zeros(2)),
        "empty response": BATCH._replace(mask_BxT=BATCH.mask_BxT.at[1].set(0.0)),
        "fully masked": BATCH._replace(mask_BxT=jnp.zeros((2, 2))),
        "huge gaps": BATCH._replace(rollout_logp_BxT=BATCH.rollout_logp_BxT - 1e4,
                          old_logp_BxT=BATCH.old_logp_BxT + 1e4),
    }
    # The IS corrections differ only in the weight; exercising them on one loss suffices.
    for corr in ("tis", "icepop", "seq_product") if name == "minirl" else ("tis",):
        cfg = LossConfig(name=name, is_correction=corr)
        for label, batch in cases.items():
            (v, metrics), g = vg(name, cfg, LOGP, batch)
            assert np.isfinite(v) and np.isfinite(g).all(), (corr, label)
            assert all(np.isfinite(n) and np.isfinite(d) for n, d in metrics.values()), label
            if label == "equal rewards":
                assert float(v) == 0.0 and not np.any(g), label
            if label == "fully masked":
                assert float(v) == 0.0 and not np.any(g), label
            reduced = dg.reduce_metrics([metrics])
            means = [k for k in reduced if label != "fully masked" or k == "loss"]
            assert all(np.isfinite(reduced[k]) for k in means), (label, reduced)


def test_jits_with_numpy_inputs():
    np_batch = jax.tree.map(np.asarray, BATCH)
    for name in losses.LOSSES:
        (v, _), g = vg(name, LossConfig(name=name), np.asarray(LOGP), np_batch)
        (v_ref, _), g_ref = vg(name, LossConfig(name=name), LOGP, BATCH)
        np.testing.assert_array_equal(v, v_ref, err_msg=name)  # the same values, traced once
        np.testing.assert_array_equal(g, g_ref, err_msg=name)
    (v, _), _ = vg("minirl", LossConfig(), np.asarray(LOGP),
                    np_batch._replace(mask_BxT=np_batch.mask_BxT.astype(bool)))
    np.testing.assert_array_equal(v, vg("minirl", LossConfig(), LOGP, BATCH)[0][0])


def test_bad_batches_name_the_key():
    with pytest.raises(ValueError, match="advantages_B"):
        losses.minirl(LOGP, BATCH._replace(advantages_B=None), LossConfig())
    with pytest.raises(ValueError, match="mask_BxT"):
        losses.minirl(LOGP, BATCH._replace(mask_BxT=jnp.ones((2, 3))), LossConfig())
    with pytest.raises(ValueError, match="advantages_B"):
        losses.minirl(LOGP, BATCH._replace(advantages_B=jnp.ones(3)), LossConfig())


def test_names_and_presets():
    assert tuple(losses.LOSSES) == LOSS_NAMES
    assert all(cfg.name in losses.LOSSES for cfg in losses.LOSS_PRESETS.values())
    assert losses.LOSS_PRESETS["minirl"] == LossConfig()
    assert all(k == k.lower() for k in list(losses.LOSSES) + list(losses.LOSS_PRESETS))


def test_config_errors_name_fields():
    for kw, field in [({"name": "ppo"}, "name"), ({"is_correction": "x"}, "is_correction"),
                      ({"aggregation": "sum"}, "aggregation"), ({"tis_cap": 0.5}, "tis_cap"),
                      ({"eps_low": 1.0}, "eps_low"), ({"cap_target": "x"}, "cap_target"),
                      ({"is_low": 2.0}, "is_low"), ({"advantage": "z"}, "advantage"),
                      ({"max_log_ratio": 0.0}, "max_log_ratio"),
                      ({"max_log_ratio": 100.0}, "max_log_ratio"),
                      ({"norm_length": -1}, "norm_length"), ({"clip": "yes"}, "clip"),
                      ({"advantage_std_ddof": 2}, "advantage_std_ddof"),
                      ({"advantage_std_ddof": True}, "advantage_std_ddof"),
                      ({"name": "grpo", "clip_ratio_c": 1.1}, "clip_ratio_c"),
                      ({"clip_ratio_c": 3.0}, "clip_ratio_c"),
                      ({"name": "gspo", "eps_high": 0.28}, "eps_high"),
                      ({"name": "grpo", "cap_target": "engine"}, "cap_target"),
                      ({"row_denominator": "some"}, "row_denominator"),
                      ({"name": "cispo", "row_denominator": "all"}, "row_denominator"),
                      ({"aggregation": "token_mean", "row_denominator": "all"},
                       "row_denominator")]:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            LossConfig(**kw)
