"""Mismatch measurement: zero for the exact engine, hand-derived values for hand-made
gaps, the exact < bf16 < fp8 ordering, and the temperature the rollout was drawn at."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax import rollout as ro
from stablerl_jax.config import ModelConfig
from stablerl_jax.mismatch import measure_mismatch
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64, max_seq_len=40,
                  moe_tile=16)
SAMPLING = ro.SamplingConfig(max_new_tokens=20, eos_id=2, pad_id=0)
# The exact engine differs from the trainer only by float reassociation (cache vs full
# sequence), far below this; hand-made gaps below are 1e-1.
EXACT_TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _setup():
    params = tf.init_params(jax.random.key(0), CFG)
    prompts = jax.random.randint(jax.random.key(1), (16, 12), 3, CFG.vocab_size)
    pad = (jnp.arange(16) % 4) * 3  # left padding of 0, 3, 6, 9 slots
    mask = jnp.arange(12)[None, :] >= pad[:, None]
    return params, jnp.where(mask, prompts, 0), mask


@functools.lru_cache(maxsize=None)
def _rollout(preset, sampling=SAMPLING):
    params, prompts, mask = _setup()
    return ro.sample(params, prompts, mask, jax.random.key(2), CFG, sampling,
                     nx.preset(preset))


def test_exact_engine_has_no_mismatch():
    params, _, _ = _setup()
    m = measure_mismatch(params, _rollout("exact"), CFG)
    assert m["completion_tokens"] > 0 and m["routed_tokens"] > 0
    assert m["abs_logp_gap_max"] <= EXACT_TOL
    assert abs(m["kl_k1"]) <= EXACT_TOL and 0 <= m["kl_k3"] <= EXACT_TOL
    assert m["routing_mismatch"] == 0.0 and m["routing_any_flip"] == 0.0
    np.testing.assert_array_equal(m["routing_mismatch_per_layer"], np.zeros(CFG.num_layers))


def test_shifted_logp_gives_hand_derived_kl():
    # logp_mu + δ on even rows and − δ on odd rows, on completion tokens only: with
    # log π = log μ_exact, log μ − log π = ±δ per token.
    params, _, _ = _setup()
    r = _rollout("exact")
    delta = 0.1
    sign_B = jnp.where(jnp.arange(r.lengths_B.shape[0]) % 2 == 0, 1.0, -1.0)
    shifted = r._replace(logp_mu_BxS=r.logp_mu_BxS
                         + delta * sign_B[:, None] * r.completion_mask_BxS)
    m = measure_mismatch(params, shifted, CFG)
    n_even = float(jnp.sum(r.lengths_B[::2]))
    n_odd = float(jnp.sum(r.lengths_B[1::2]))
    n = n_even + n_odd
    assert m["completion_tokens"] == n
    k1 = (n_even - n_odd) * delta / n
    # k3 term with x = log(π/μ) = ∓δ: e^x − 1 − x.
    k3 = (n_even * (np.exp(-delta) - 1 + delta) + n_odd * (np.exp(delta) - 1 - delta)) / n
    np.testing.assert_allclose(m["kl_k1"], k1, atol=2 * EXACT_TOL)
    np.testing.assert_allclose(m["kl_k3"], k3, rtol=1e-3)
    np.testing.assert_allclose(m["abs_logp_gap_mean"], delta, atol=2 * EXACT_TOL)
    np.testing.assert_allclose(m["abs_logp_gap_max"], delta, atol=2 * EXACT_TOL)
    assert m["routing_mismatch"] == 0.0  # routes untouched


def test_flipped_routes_give_hand_derived_rates():
    # In layer 1 of row 0, replace the second expert of every recorded token by one the
    # router did not choose: half of that token's top-2 set is wrong.
    params, _, _ = _setup()
    r = _rollout("exact")
    routes = np.array(r.routes_mu_LxBxSxK)
    rec_BxS = (routes >= 0).all(axis=(0, 3))
    row0 = np.nonzero(rec_BxS[0])[0]
    for s in row0:
        chosen = set(routes[1, 0, s])
        routes[1, 0, s, 1] = min(set(range(CFG.num_experts)) - chosen)
    m = measure_mismatch(params, r._replace(routes_mu_LxBxSxK=jnp.asarray(routes)), CFG)
    n = rec_BxS.sum()
    assert m["routed_tokens"] == n
    np.testing.assert_allclose(m["routing_mismatch_per_layer"], [0.0, 0.5 * len(row0) / n],
                               rtol=1e-6)
    np.testing.assert_allclose(m["routing_any_flip"], len(row0) / n, rtol=1e-6)
    assert m["abs_logp_gap_max"] <= EXACT_TOL  # log-probs untouched


def test_mismatch_is_ordered_exact_bf16_fp8():
    params, _, _ = _setup()
    m = {p: measure_mismatch(params, _rollout(p), CFG) for p in ("exact", "bf16", "fp8")}
    for stat in ("kl_k3", "abs_logp_gap_mean", "abs_logp_gap_max"):
        assert m["exact"][stat] < m["bf16"][stat] < m["fp8"][stat], stat
    assert m["exact"]["routing_mismatch"] == 0.0
    assert m["bf16"]["routing_mismatch"] < m["fp8"]["routing_mismatch"]
    assert m["fp8"]["routing_any_flip"] > 0  # fp8 flips some routes


def test_measured_at_the_sampling_temperature():
    params, _, _ = _setup()
    hot = ro.SamplingConfig(max_new_tokens=20, temperature=0.7, eos_id=2, pad_id=0)
    r = _rollout("exact", hot)
    assert measure_mismatch(params, r, CFG, temperature=0.7)["abs_logp_gap_max"] <= EXACT_TOL
    # Scored at the wrong temperature the gap is no longer numerical noise.
    assert measure_mismatch(params, r, CFG, temperature=1.0)["abs_logp_gap_mean"] > 1e-3
    with pytest.raises(ValueError, match="^temperature:"):
        measure_mismatch(params, r, CFG, temperature=0.0)


@pytest.mark.slow
def test_train_numerics_is_the_reference():
    # Scoring the bf16 engine's samples with a bf16 trainer removes the weight and
    # activation rounding gap; only the engines' algorithmic difference is left.
    params, _, _ = _setup()
    r = _rollout("bf16")
    vs_train = measure_mismatch(params, r, CFG)
    vs_bf16 = measure_mismatch(params, r, CFG, train_numerics=nx.preset("bf16"))
    assert vs_bf16["abs_logp_gap_mean"] < vs_train["abs_logp_gap_mean"]
