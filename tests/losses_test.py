"""Losses on tiny batches with hand-derived values and gradients, and the first-order claim."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax import losses
from stablerl_jax.config import ConfigError, LossConfig

L = np.log


def _batch(logp, old, mu, adv, mask):
    return (jnp.asarray(L(logp), jnp.float32),
            {"old_logp_BxT": jnp.asarray(L(old), jnp.float32),
             "rollout_logp_BxT": jnp.asarray(L(mu), jnp.float32),
             "advantages_B": jnp.asarray(adv, jnp.float32),
             "mask_BxT": jnp.asarray(mask, jnp.float32)})


# Response 0: Â=+1, ρ = [2, 0.8], r = [1, 0.8] (kept). Response 1: Â=−1, r_0 = 0.5 < 0.8
# → masked by the clip; its second token is padding.
LOGP, BATCH = _batch(logp=[[0.5, 0.4], [0.1, 0.9]], old=[[0.5, 0.5], [0.2, 0.9]],
                     mu=[[0.25, 0.5], [0.2, 0.9]], adv=[1.0, -1.0], mask=[[1, 1], [1, 0]])


def _value_and_grad(name, cfg, logp=LOGP, batch=BATCH):
    f = lambda lp: losses.LOSSES[name](lp, batch, cfg)[0]
    return jax.value_and_grad(f)(logp)


def test_minirl_by_hand():
    v, g = _value_and_grad("minirl", LossConfig())
    np.testing.assert_allclose(v, -(2 * L(0.5) + 0.8 * L(0.4)) / 2, rtol=1e-6)
    np.testing.assert_allclose(g, [[-1.0, -0.4], [0.0, 0.0]], atol=1e-6)


def test_minirl_ablations_by_hand():
    # + length normalization: response 0's sum divided by |y_0| = 2.
    v, g = _value_and_grad("minirl", LossConfig(aggregation="seq_mean_token_mean"))
    np.testing.assert_allclose(v, -(2 * L(0.5) + 0.8 * L(0.4)) / 2 / 2, rtol=1e-6)
    # w/o train–inference IS: weight 1.
    v, g = _value_and_grad("minirl", LossConfig(use_is=False))
    np.testing.assert_allclose(g, [[-0.5, -0.5], [0.0, 0.0]], atol=1e-6)
    # no clipping: response 1's token counts with ρ = 0.1/0.2 = 0.5 and Â = −1.
    v, g = _value_and_grad("minirl", LossConfig(clip=False))
    np.testing.assert_allclose(g, [[-1.0, -0.4], [0.25, 0.0]], atol=1e-6)
    np.testing.assert_allclose(v, -(2 * L(0.5) + 0.8 * L(0.4) - 0.5 * L(0.1)) / 2, rtol=1e-6)


def test_minirl_cap_and_engine_target():
    logp, batch = _batch([[0.5]], [[0.5]], [[0.05]], [1.0], [[1]])  # ρ = 10 > C = 5
    _, g = _value_and_grad("minirl", LossConfig(), logp, batch)
    np.testing.assert_allclose(g, [[-5.0]], rtol=1e-6)
    # cap on π_old/μ only, times the staleness ratio r = 0.6/0.5.
    logp, batch = _batch([[0.6]], [[0.5]], [[0.05]], [1.0], [[1]])
    _, g = _value_and_grad("minirl", LossConfig(cap_target="engine"), logp, batch)
    np.testing.assert_allclose(g, [[-5.0 * 1.2]], rtol=1e-5)


def test_is_corrections_by_hand():
    x = jnp.log(jnp.array([[0.3, 1.5, 3.0]]))
    m = jnp.ones((1, 3))
    w = lambda mode, **kw: losses.is_weight(x, m, LossConfig(is_correction=mode, **kw))
    np.testing.assert_allclose(w("tis", tis_cap=2.0), [[0.3, 1.5, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(w("mis"), [[0.3, 1.5, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(w("icepop"), [[0.0, 1.5, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(w("seq_product"), np.full((1, 3), 1.35), rtol=1e-5)
    np.testing.assert_allclose(w("seq_geomean"), np.full((1, 3), 1.35 ** (1 / 3)), rtol=1e-5)
    np.testing.assert_allclose(w("none"), np.ones((1, 3)))


def test_grpo_by_hand():
    # Response 0: r = [1.5 (clipped at 1.27), 1.0]; response 1: r = 0.5 → −clip = −0.8.
    logp, batch = _batch([[0.75, 0.5], [0.1, 0.9]], [[0.5, 0.5], [0.2, 0.9]],
                         [[0.5, 0.5], [0.2, 0.9]], [1.0, -1.0], [[1, 1], [1, 0]])
    v, g = _value_and_grad("grpo", LossConfig(name="grpo", use_is=False), logp, batch)
    np.testing.assert_allclose(v, -((1.27 + 1.0) / 2 + (-0.8)) / 2, rtol=1e-6)
    np.testing.assert_allclose(g, [[0.0, -0.25], [0.0, 0.0]], atol=1e-6)
    # DAPO: same term, token mean over 3 tokens.
    v, g = _value_and_grad("dapo", LossConfig(name="dapo", use_is=False), logp, batch)
    np.testing.assert_allclose(v, -(1.27 + 1.0 - 0.8) / 3, rtol=1e-6)
    np.testing.assert_allclose(g, [[0.0, -1 / 3], [0.0, 0.0]], atol=1e-6)


def test_cispo_by_hand():
    logp, batch = _batch([[0.75, 0.5], [0.1, 0.9]], [[0.5, 0.5], [0.2, 0.9]],
                         [[0.5, 0.5], [0.2, 0.9]], [1.0, -1.0], [[1, 1], [1, 0]])
    v, g = _value_and_grad("cispo", LossConfig(name="cispo", use_is=False), logp, batch)
    np.testing.assert_allclose(v, -(1.27 * L(0.75) + L(0.5) - 0.8 * L(0.1)) / 3, rtol=1e-6)
    # Every token keeps a gradient, scaled by its clipped ratio.
    np.testing.assert_allclose(g, [[-1.27 / 3, -1 / 3], [0.8 / 3, 0.0]], atol=1e-6)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_by_hand(name):
    # r = [1.0002, 1]: s = 1.0002^(1/2) inside [1 − 3e-4, 1 + 4e-4].
    logp, batch = _batch([[0.50010, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [1.0], [[1, 1]])
    v, g = _value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
    s = np.sqrt(0.5001 / 0.5)
    np.testing.assert_allclose(v, -s, rtol=1e-6)
    np.testing.assert_allclose(g, [[-s / 2, -s / 2]], rtol=1e-5)
    # Outside the tiny range the clipped branch has no gradient.
    logp, batch = _batch([[0.51, 0.5]], [[0.5, 0.5]], [[0.5, 0.5]], [1.0], [[1, 1]])
    v, g = _value_and_grad(name, LossConfig(name=name, use_is=False), logp, batch)
    np.testing.assert_allclose(v, -(1 + 4e-4), rtol=1e-6)
    np.testing.assert_allclose(g, 0.0, atol=1e-7)


def test_minirl_gradient_equals_eq4_when_no_cap_binds():
    """∇ of Eq. 7 == ∇ of the Eq. 3 surrogate Σ M ρ Â (whose gradient is Eq. 4)."""
    k = jax.random.split(jax.random.key(0), 5)
    theta = jax.random.normal(k[0], (4, 6, 5))  # logits of a tiny policy
    tokens = jax.random.randint(k[1], (4, 6), 0, 5)
    logp_of = lambda th: jnp.take_along_axis(jax.nn.log_softmax(th), tokens[..., None], -1)[..., 0]
    mu = logp_of(theta + 0.1 * jax.random.normal(k[2], theta.shape))
    old = logp_of(theta + 0.05 * jax.random.normal(k[3], theta.shape))
    batch = {"old_logp_BxT": old, "rollout_logp_BxT": mu,
             "advantages_B": jnp.array([1.0, -0.5, 2.0, -1.5]),
             "mask_BxT": (jax.random.uniform(k[4], (4, 6)) > 0.2).astype(jnp.float32)}
    cfg = LossConfig(tis_cap=1e6)
    g7 = jax.grad(lambda th: losses.minirl(logp_of(th), batch, cfg)[0])(theta)

    def eq3(th):
        lp = logp_of(th)
        r = jnp.exp(jax.lax.stop_gradient(lp) - old)
        a = batch["advantages_B"][:, None]
        keep = ~(((a > 0) & (r > 1.27)) | ((a < 0) & (r < 0.8)))
        return -jnp.sum(keep * jnp.exp(lp - mu) * a * batch["mask_BxT"]) / 4

    np.testing.assert_allclose(g7, jax.grad(eq3)(theta), rtol=1e-5, atol=1e-7)


def _tabular(theta):
    """Autoregressive policy over V=2, length 2: logits θ[prefix] for prefixes (), (0,), (1,)."""
    seqs = np.array(list(itertools.product([0, 1], repeat=2)))
    logp0 = jax.nn.log_softmax(theta[0])[seqs[:, 0]]
    logp1 = jax.nn.log_softmax(theta[1 + seqs[:, 0]], axis=-1)[np.arange(4), seqs[:, 1]]
    return seqs, jnp.stack([logp0, logp1], axis=1)  # [4 sequences, 2 tokens]


def test_token_surrogate_is_first_order_approximation_of_sequence_objective():
    theta_mu = jnp.array([[0.3, -0.2], [1.0, 0.1], [-0.5, 0.4]])
    seqs, logp_mu = _tabular(theta_mu)
    reward = jnp.array([1.0, 0.0, 0.0, 1.0])
    mu_seq = jnp.exp(logp_mu.sum(1))
    direction = jnp.array([[1.0, -1.0], [-0.5, 0.7], [0.8, -0.2]])

    def gap(scale):
        theta = theta_mu + scale * direction
        # Exact Eq. 1: J_seq(θ) = E_μ[π/μ R] = Σ_y π_θ(y) R(y).
        g_seq = jax.grad(lambda th: jnp.sum(jnp.exp(_tabular(th)[1].sum(1)) * reward))(theta)
        # Token surrogate through MiniRL with μ(y)·R(y)·4 as the advantage (weights the 4
        # enumerated sequences by their probability), no cap, no clip.
        batch = {"old_logp_BxT": logp_mu, "rollout_logp_BxT": logp_mu,
                 "advantages_B": mu_seq * reward * 4, "mask_BxT": jnp.ones((4, 2))}
        cfg = LossConfig(clip=False, tis_cap=1e9)
        g_tok = -jax.grad(lambda th: losses.minirl(_tabular(th)[1], batch, cfg)[0])(theta)
        return float(jnp.linalg.norm(g_tok - g_seq) / jnp.linalg.norm(g_seq))

    gaps = [gap(s) for s in (0.0, 0.05, 0.2, 0.5)]
    assert gaps[0] < 1e-6  # exact at π_θ = μ_old
    assert gaps[1] > 1e-4
    assert gaps[1] < gaps[2] < gaps[3]  # and degrades as δ_t grow


def test_microbatch_accumulation_equals_full_batch():
    k = jax.random.split(jax.random.key(1), 4)
    logp = -jax.random.uniform(k[0], (8, 5), minval=0.1, maxval=3.0)
    batch = {"old_logp_BxT": logp + 0.3 * jax.random.normal(k[1], (8, 5)),
             "rollout_logp_BxT": logp + 0.3 * jax.random.normal(k[2], (8, 5)),
             "advantages_B": jnp.array([1.0, -1, 0.5, -0.5, 2, -2, 0, 1]),
             "mask_BxT": (jax.random.uniform(k[3], (8, 5)) > 0.3).astype(jnp.float32)}
    cfg = LossConfig()
    full = losses.reduce_metrics([losses.minirl(logp, batch, cfg)[1]])
    halves = [losses.minirl(logp[s], {n: v[s] for n, v in batch.items()}, cfg)[1]
              for s in (slice(0, 4), slice(4, 8))]
    parts = losses.reduce_metrics(halves)
    for key in full:
        np.testing.assert_allclose(parts[key], full[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_masked_tokens_contribute_nothing():
    logp2 = LOGP.at[1, 1].set(-50.0)  # a masked slot with absurd values
    batch2 = dict(BATCH, rollout_logp_BxT=BATCH["rollout_logp_BxT"].at[1, 1].set(10.0))
    for name in losses.LOSSES:
        cfg = LossConfig(name=name)
        v1, g1 = _value_and_grad(name, cfg)
        v2, g2 = _value_and_grad(name, cfg, logp2, batch2)
        np.testing.assert_allclose(v2, v1, rtol=1e-6, err_msg=name)
        assert float(g2[1, 1]) == 0.0


@pytest.mark.parametrize("name", list(losses.LOSSES))
def test_degenerate_batches_are_finite(name):
    cfg = LossConfig(name=name)
    cases = {
        "equal rewards": dict(BATCH, advantages_B=jnp.zeros(2)),
        "empty response": dict(BATCH, mask_BxT=BATCH["mask_BxT"].at[1].set(0.0)),
        "fully masked": dict(BATCH, mask_BxT=jnp.zeros((2, 2))),
        "huge gaps": dict(BATCH, rollout_logp_BxT=BATCH["rollout_logp_BxT"] - 1e4,
                          old_logp_BxT=BATCH["old_logp_BxT"] + 1e4),
    }
    for label, batch in cases.items():
        (v, metrics), g = jax.value_and_grad(
            lambda lp: losses.LOSSES[name](lp, batch, cfg), has_aux=True)(LOGP)
        assert np.isfinite(v) and np.isfinite(g).all(), label
        assert all(np.isfinite(losses.reduce_metrics([metrics])[k]) for k in metrics), label


def test_jits_with_numpy_inputs():
    np_batch = {k: np.asarray(v) for k, v in BATCH.items()}
    for name, fn in losses.LOSSES.items():
        v, _ = jax.jit(fn, static_argnums=2)(np.asarray(LOGP), np_batch, LossConfig(name=name))
        assert np.isfinite(v)


def test_config_errors_name_fields():
    for kw, field in [({"name": "ppo"}, "name"), ({"is_correction": "x"}, "is_correction"),
                      ({"aggregation": "sum"}, "aggregation"), ({"tis_cap": 0.5}, "tis_cap"),
                      ({"eps_low": 1.0}, "eps_low"), ({"cap_target": "x"}, "cap_target"),
                      ({"is_low": 2.0}, "is_low"), ({"advantage": "z"}, "advantage"),
                      ({"max_log_ratio": 0.0}, "max_log_ratio")]:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            LossConfig(**kw)
