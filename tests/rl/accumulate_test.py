"""Micro-batching is exact: N accumulated micro-batches equal one batch in loss, gradient
and every metric pair, under every aggregation (float64: the test is about the algebra,
tests/tolerance.py); score and sampler slices give the unsliced results."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg
from tolerance import assert_close, backward_chain, engine_chain

from stablerl_jax.config import AGGREGATIONS, LOSS_NAMES, LossConfig
from stablerl_jax.data.batching import SFTBatch
from stablerl_jax.method import losses
from stablerl_jax.method.losses import LossBatch
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import accumulate, step_fns
from stablerl_jax.rl.engine import Engine

REWARDS = np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float64)
N = 4  # micro-batches of 2 rows


def _f64(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cfg(**kw):
    cfg = tiny_cfg(replay="r2", num_minibatches=1, **kw)
    # A router z-loss, so the router loss's share-weighting is checked too.
    model = cfg.model.replace(param_dtype="float64", compute_dtype="float64",
                              router_z_loss_weight=0.1)
    return cfg.replace(model=model, sampling=cfg.sampling.replace(numerics="exact"))


@functools.lru_cache(maxsize=None)
def _scored():
    """(cfg, params, rollout, batch): one float64 rollout of 8 rows, scored."""
    with jax.enable_x64(True):
        cfg = _cfg()
        params = _f64(tf.init_params(jax.random.key(0), cfg.model))
        prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
        mask = jnp.ones((8, 8), bool).at[:2, :3].set(False)
        eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
        ro = eng.sample(params, jnp.where(mask, prompts, 0), mask, jax.random.key(2))
        batch, _ = eng.score(params, ro, REWARDS)
        return cfg, params, ro, batch


def _compare(one, acc, cfg, batch):
    """(loss, metrics), grads of one batch vs accumulated, to the float64 rounding bound
    (the same rule and counts as the sharded-update test: the slices only reorder the
    sums over rows)."""
    (l0, m0), g0 = one
    (l1, m1), g1 = acc
    tokens = int(np.asarray(batch.attn_BxS).sum())
    n = backward_chain(cfg.model, batch.tokens_BxS.shape[1], tokens) + 2 * N
    assert_close(l1, l0, n=n, dtype="float64", cond=tokens, scale=max(abs(float(l0)), 1.0))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, n=n, dtype="float64", cond=tokens, scale="max")
    assert set(m1) == set(m0)
    # A numerator sums at most `den` per-token terms of size ≤ max_log_ratio².
    term = cfg.loss.max_log_ratio ** 2
    for k in m0:
        for i in range(2):
            assert_close(m1[k][i], m0[k][i], n=n, dtype="float64",
                         scale=term * max(float(np.max(m0[k][1])), 1.0), err_msg=k)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_accumulated_losses_equal_one_batch(x64, name):
    """Every loss under every aggregation: a per-row 'model' (a table of log-probs, one
    row per response) makes the loss itself the whole computation, so this isolates the
    algebra of the totals and of `diagnostics.combine_pairs`."""
    b, t = 8, 6
    k = jax.random.split(jax.random.key(3), 4)
    mask = (jax.random.uniform(k[0], (b, t)) < 0.7).astype(jnp.float64).at[3].set(0.0)
    logp = jnp.log(jax.random.uniform(k[1], (b, t), jnp.float64, 0.05, 1.0))
    old = logp + 0.3 * jax.random.normal(k[2], (b, t), jnp.float64)
    mu = old + 0.3 * jax.random.normal(k[3], (b, t), jnp.float64)
    batch = LossBatch(old, mu, mask, advantages_B=jnp.linspace(-1.0, 1.0, b))
    rows = jnp.arange(b)
    for aggregation in AGGREGATIONS:
        cfg = LossConfig(name=name, aggregation=aggregation)

        def loss_fn(table, part, totals=None):
            rows_, lb = part
            return losses.LOSSES[name](table[rows_], lb._replace(totals=totals), cfg)

        one = jax.value_and_grad(loss_fn, has_aux=True)(logp, (rows, batch))
        totals = losses.mask_totals(mask)
        acc = accumulate.value_and_grad(lambda q, part: loss_fn(q, part, totals), logp,
                                        (rows, batch), N)
        # Sums over ≤ b·t terms in another order, plus the exp/log of the ratios.
        n = b * t + 16
        (l0, m0), g0 = one
        (l1, m1), g1 = acc
        assert_close(l1, l0, n=n, dtype="float64", scale=1.0, err_msg=aggregation)
        assert_close(g1, g0, n=n, dtype="float64", scale="max", err_msg=aggregation)
        for key in m0:
            for i in range(2):
                assert_close(m1[key][i], m0[key][i], n=n, dtype="float64",
                             scale=cfg.max_log_ratio ** 2 * max(float(m0[key][1]), 1.0),
                             err_msg=f"{aggregation} {key}")


def test_accumulated_rl_update_equals_one_batch(x64):
    """The whole model, token-mean (the aggregation that needs the global token count)
    and a router z-loss (weighted by each slice's share of the routed tokens)."""
    cfg, params, _, batch = _scored()
    cfg = cfg.replace(loss=LossConfig(aggregation="token_mean"))
    _compare_one_and_accumulated(step_fns.rl_loss, cfg, params, batch)


def test_accumulated_sft_update_equals_one_batch(x64):
    cfg, params, ro, _ = _scored()
    attn = ro.prompt_mask_BxS | ro.completion_mask_BxS
    batch = SFTBatch(ro.tokens_BxS, attn, ro.completion_mask_BxS[:, 1:].astype(jnp.float64))
    _compare_one_and_accumulated(step_fns.sft_loss, cfg, params, batch)


def _compare_one_and_accumulated(loss_fn, cfg, params, batch):
    """`loss_fn` on the whole batch vs accumulated over N micro-batches, each slice's
    loss written with the whole batch's totals."""
    loss = functools.partial(loss_fn, cfg=cfg)
    one = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, batch, None)
    totals = step_fns.batch_totals(batch)
    acc = jax.jit(lambda p, b: accumulate.value_and_grad(
        lambda q, part: loss(q, part, totals), p, b, N))(params, batch)
    _compare(one, acc, cfg, batch)


def test_engine_microbatches_take_the_same_step(x64):
    """Through the Engine: rl.microbatches=4 gives the one-batch update's parameters."""
    cfg, params, _, batch = _scored()
    results = []
    for m in (1, N):
        eng = Engine.create(cfg.replace(rl=cfg.rl.replace(microbatches=m)), eos_id=EOS_ID,
                            pad_id=PAD_ID)
        state, metrics = eng.update(eng.init_state(params), batch)
        results.append(jax.tree.map(np.asarray, state.params))
    tokens = int(np.asarray(batch.attn_BxS).sum())
    n = backward_chain(cfg.model, batch.tokens_BxS.shape[1], tokens) + 2 * N + 16  # + AdamW
    for a, b in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        assert_close(a, b, n=n, dtype="float64", cond=tokens, scale="max")


def test_score_and_sampler_slices_equal_one_pass(x64):
    cfg, params, ro, batch = _scored()
    sliced = cfg.replace(rl=cfg.rl.replace(microbatches=N),
                         sampling=cfg.sampling.replace(max_batch=2))
    eng = Engine.create(sliced, eos_id=EOS_ID, pad_id=PAD_ID)
    batch_s, _ = eng.score(params, ro, REWARDS)
    n = engine_chain(cfg.model, ro.tokens_BxS.shape[1])  # one log-prob, other sum order
    assert_close(batch_s.old_logp_BxT, batch.old_logp_BxT, n=n, dtype="float64", scale="max")
    np.testing.assert_array_equal(batch_s.replay_BxTxLxK, batch.replay_BxTxLxK)
    prompts, mask = ro.tokens_BxS[:, :8], ro.prompt_mask_BxS[:, :8]
    ro_s = eng.sample(params, prompts, mask, jax.random.key(2))
    # Each row draws from its own key: the same tokens, up to float64 rounding of μ.
    np.testing.assert_array_equal(ro_s.tokens_BxS, ro.tokens_BxS)
    assert_close(ro_s.logp_mu_BxS, ro.logp_mu_BxS, n=n, dtype="float64", scale="max")


def test_microbatches_must_divide_the_minibatch():
    with pytest.raises(Exception, match="microbatches"):
        tiny_cfg(microbatches=3)
