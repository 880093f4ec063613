"""Score centering (method/centering.py): on hand-made batches in float64, the centred
gradient with respect to the logits is Σ_t c_t (e_y − q_t), against a numpy reference; for
every loss of the table and the IS corrections it differs from the plain gradient by
exactly the drift term; where q and π are the same bits it is the plain gradient; the
top-k head with its tail keeps q's mass. Trust-region masking: a masked response
contributes nothing in any loss and is counted in its metric; the options' settings are
refused at config time."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close

from stablerl_jax.config import ConfigError, ExperimentConfig, LossConfig, apply_overrides
from stablerl_jax.method import centering, losses
from stablerl_jax.config.loss_table import LOSS_TABLE
from stablerl_jax.method.losses import LossBatch

B, T, V = 3, 4, 6
ADV = np.array([1.0, -0.5, 0.25])
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], np.float64)


def _hand_batch(mismatch: float = 0.3):
    """Logits ζ [B, T, V], tokens y, the sampler's log q (ζ plus `mismatch` noise) and a
    LossBatch whose π_old = π_θ and μ = q at the sampled tokens."""
    rng = np.random.default_rng(0)
    zeta = rng.normal(size=(B, T, V))
    y = rng.integers(0, V, size=(B, T))
    logq = jax.nn.log_softmax(zeta + mismatch * rng.normal(size=zeta.shape), -1)
    logpi = jax.nn.log_softmax(zeta, -1)
    at_y = lambda lp: np.take_along_axis(np.asarray(lp), y[..., None], -1)[..., 0]
    batch = LossBatch(old_logp_BxT=jnp.asarray(at_y(logpi)),
                      rollout_logp_BxT=jnp.asarray(at_y(logq)), mask_BxT=jnp.asarray(MASK),
                      advantages_B=jnp.asarray(ADV))
    return jnp.asarray(zeta), y, jnp.asarray(logq), batch


def _grads(name, cfg, zeta, y, logq, batch):
    """(d L/d ζ, d L_c/d ζ, c = d L/d log π(y)) of loss `name` on the hand batch."""
    fn = losses.LOSSES[name]

    def plain(z):
        logp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), y[..., None], -1)[..., 0]
        return fn(logp, batch, cfg)[0]

    def centred(z):
        logpi = jax.nn.log_softmax(z, -1)
        logp = jnp.take_along_axis(logpi, y[..., None], -1)[..., 0]
        return centering.centered(fn, logp, batch, cfg, z, logpi, logq)[0]

    logp0 = jnp.take_along_axis(jax.nn.log_softmax(zeta, -1), y[..., None], -1)[..., 0]
    c = centering.coefficients(fn, logp0, batch, cfg)
    assert centred(zeta) == plain(zeta)  # the correction's value is exactly 0
    return jax.grad(plain)(zeta), jax.grad(centred)(zeta), c


def test_minirl_centred_gradient_matches_a_float64_reference(x64):
    zeta, y, logq, batch = _hand_batch()
    _, g_c, _ = _grads("minirl", LossConfig(), zeta, y, logq, batch)
    # Reference: on-policy (π_old = π_θ) MiniRL's coefficient is −min(π/μ, C)·Â/B' at
    # every scored token (no clip binds at r = 1), and the centred score is e_y − q.
    pi, q = np.exp(jax.nn.log_softmax(np.asarray(zeta), -1)), np.exp(np.asarray(logq))
    w = np.minimum(np.exp(np.asarray(batch.old_logp_BxT - batch.rollout_logp_BxT)), 5.0)
    c = -MASK * w * ADV[:, None] / B
    ref = c[..., None] * (np.eye(V)[y] - q)
    assert not np.allclose(ref, c[..., None] * (np.eye(V)[y] - pi))  # q ≠ π here
    # A handful of float64 roundings per entry: the log-softmax (V), the weight (7), the
    # product and the difference (4).
    assert_close(g_c, ref, n=V + 11, dtype="float64", scale="max")


LOSS_CASES = [(name, LossConfig(name=name)) for name in LOSS_TABLE] + [
    ("minirl", LossConfig(is_correction=mode)) for mode in
    ("none", "mis", "icepop", "seq_product", "seq_geomean")] + [
    ("minirl", LossConfig(trust_region="abs", trust_region_delta=0.4)),
    ("grpo", LossConfig(name="grpo", advantage="group_norm", use_is=True,
                        is_correction="icepop"))]


@pytest.mark.parametrize("name,cfg", LOSS_CASES, ids=lambda c: getattr(c, "name", c))
def test_centring_removes_exactly_the_drift_term_for_every_loss(x64, name, cfg):
    zeta, y, logq, batch = _hand_batch()
    g, g_c, c = _grads(name, cfg, zeta, y, logq, batch)
    drift = np.exp(np.asarray(logq)) - np.exp(jax.nn.log_softmax(np.asarray(zeta), -1))
    expected = np.asarray(g) - np.asarray(c)[..., None] * drift * MASK[..., None]
    assert np.any(np.asarray(c) != 0)
    assert_close(g_c, expected, n=V + 11, dtype="float64", scale="max")


def test_where_q_is_pi_bit_for_bit_the_centred_gradient_is_the_plain_one():
    zeta, y, _, batch = _hand_batch()
    logpi = jax.nn.log_softmax(zeta, -1)
    at_y = np.take_along_axis(np.asarray(logpi), y[..., None], -1)[..., 0]
    batch = batch._replace(rollout_logp_BxT=jnp.asarray(at_y, jnp.float32))
    g, g_c, _ = _grads("minirl", LossConfig(), zeta.astype(jnp.float32), y,
                       logpi.astype(jnp.float32), batch)
    # sg[q − π] is formed as π·expm1(log q − log π): exactly 0 for the same bits, so the
    # correction adds exact zeros to the cotangent.
    np.testing.assert_array_equal(g_c, g)


def test_the_topk_head_with_its_tail_keeps_q_and_converges_to_it(x64):
    rng = np.random.default_rng(1)
    logq = jax.nn.log_softmax(jnp.asarray(2 * rng.normal(size=(2, 3, 50))), -1)
    pi = jnp.exp(jax.nn.log_softmax(logq + jnp.asarray(0.5 * rng.normal(size=logq.shape)),
                                    -1))
    q = np.exp(np.asarray(logq))
    errors = []
    for k in (1, 4, 16, 49):
        head, idx = jax.lax.top_k(logq, k)
        approx = np.asarray(centering.head_tail(jnp.exp(head), idx, pi))
        assert_close(approx.sum(-1), 1.0, n=50, dtype="float64", scale=1.0)
        tail = 1 - np.sort(q, -1)[..., ::-1][..., :k].sum(-1)
        err = np.abs(approx - q).sum(-1)
        # Both tails hold the same mass 1 − Σ_K q, so they are at most twice it apart.
        assert np.all(err <= 2 * tail + 1e-12)
        errors.append(err.mean())
    assert errors == sorted(errors, reverse=True)


def _tr_batch():
    # Response 0: log μ − log π_old = [ln 2, 0] (max k1 0.69); response 1: [−ln 2, −ln 3]
    # (k1 ≤ 0, |log ratio| up to 1.10); response 2: within 0.1 everywhere.
    lg = np.log
    old = np.array([[0.25, 0.5], [0.5, 0.3], [0.5, 0.5]])
    mu = np.array([[0.5, 0.5], [0.25, 0.1], [0.52, 0.48]])
    return (jnp.asarray(lg(old), jnp.float32),
            LossBatch(jnp.asarray(lg(old), jnp.float32), jnp.asarray(lg(mu), jnp.float32),
                      jnp.ones((3, 2), jnp.float32), jnp.asarray([1.0, -1.0, 0.5],
                                                                 jnp.float32)))


@pytest.mark.parametrize("name", list(LOSS_TABLE))
@pytest.mark.parametrize("mode,masked", [("k1", (0,)), ("abs", (0, 1))])
def test_trust_region_masking_drops_whole_responses_in_every_loss(name, mode, masked):
    logp, batch = _tr_batch()
    cfg = LossConfig(name=name, trust_region=mode, trust_region_delta=0.5)
    adv = np.asarray(batch.advantages_B).copy()
    adv[list(masked)] = 0.0
    zeroed = batch._replace(advantages_B=jnp.asarray(adv))
    vg = lambda c, b: jax.value_and_grad(lambda lp: losses.LOSSES[name](lp, b, c),
                                         has_aux=True)(logp)
    (loss, metrics), grad = vg(cfg, batch)
    (loss0, _), grad0 = vg(LossConfig(name=name), zeroed)
    # The same arithmetic on the same advantages: the same bits.
    assert float(loss) == float(loss0)
    np.testing.assert_array_equal(grad, grad0)
    assert np.all(np.asarray(grad)[list(masked)] == 0)
    num, den = metrics["trust_region/frac_masked"]
    assert (float(num), float(den)) == (len(masked), 3.0)


@pytest.mark.parametrize("overrides,field", [
    (["loss.center=mean"], "loss.center"),
    (["loss.center_k=8"], "loss.center_k"),
    (["loss.center=topk", "loss.center_k=0"], "loss.center_k"),
    (["loss.center=topk", "loss.center_k=99999"], "loss.center_k"),
    (["loss.trust_region=kl"], "loss.trust_region"),
    (["loss.trust_region=k1", "loss.trust_region_delta=-1"], "loss.trust_region_delta"),
    (["loss.trust_region_delta=0.1"], "loss.trust_region_delta"),
    (["loss.center=exact", "rl.pack_tokens=4096"], "loss.center"),
    (["loss.center=exact", "sampling.top_k=20"], "loss.center"),
    (["rl.drift_monitor=true", "rl.score_in_update=true", "rl.num_minibatches=1"],
     "rl.drift_monitor"),
])
def test_bad_settings_are_one_line_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        apply_overrides(ExperimentConfig(), overrides)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)
