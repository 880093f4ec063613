"""Mismatch measurement: zero for the exact engine, hand-derived values for hand-made
gaps, the exact < bf16 < fp8 ordering, and the temperature the rollout was drawn at."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import LAMBDA, assert_close, bound, engine_chain

from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.method.mismatch import measure_mismatch
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import rollout as ro

CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64, max_seq_len=40,
                  moe_tile=16)
SAMPLING = SamplingConfig(max_new_tokens=20)


def exact_tol(rollout):
    """The exact engine differs from the trainer only by float32 summation order (cache
    vs full sequence): the probabilistic bound of a log-prob's chain (tests/tolerance.py)
    times the largest log-prob. The bf16 engine's gaps are ~100× larger, the hand-made
    gaps below 1e-1."""
    slots = rollout.tokens_BxS.shape[1]
    scale = float(np.abs(np.asarray(rollout.logp_mu_BxS)).max())
    return bound(engine_chain(CFG, slots), lam=LAMBDA) * scale


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
                     nx.numerics_preset(preset), eos_id=2, pad_id=0)


def test_exact_engine_has_no_mismatch():
    params, _, _ = _setup()
    r = _rollout("exact")
    m = measure_mismatch(params, r, CFG)
    tol = exact_tol(r)
    assert m["completion_tokens"] > 0 and m["routed_tokens"] > 0
    assert m["abs_logp_gap_max"] <= tol
    # k1 is a mean of per-token gaps; k3 ≈ gap²/2 per token.
    assert abs(m["kl_k1"]) <= tol and 0 <= m["kl_k3"] <= tol**2
    assert m["routing_mismatch"] == 0.0 and m["routing_any_flip"] == 0.0
    np.testing.assert_array_equal(m["routing_mismatch_per_layer"], np.zeros(CFG.num_layers))


def test_shifted_logp_gives_hand_derived_kl():
    # logp_mu + δ on even rows and − δ on odd rows, on completion tokens only: with
    # log π = log μ_exact, log μ − log π = ±δ per token.
    params, _, _ = _setup()
    r = _rollout("exact")
    gap = measure_mismatch(params, r, CFG)  # the exact engine's own (rounding) gap
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
    # k1 is linear in the shift: k1 + the unshifted k1, up to rounding of the n-token sums
    # of ±δ-sized terms.
    assert_close(m["kl_k1"], k1 + gap["kl_k1"], n=int(n) + 4, scale=delta)
    # Per token the gap g ≤ gap_max moves x = ∓δ + g, and ∂(e^x − 1 − x)/∂x = e^x − 1,
    # at most e^δ − 1 < 1.2·δ in size: |Δk3| ≤ 1.2·δ·gap_max (+ rounding).
    assert abs(m["kl_k3"] - k3) <= 1.2 * delta * gap["abs_logp_gap_max"] + bound(
        int(n) + 8) * k3
    # |±δ + g| = δ ± g when |g| < δ.
    for stat in ("abs_logp_gap_mean", "abs_logp_gap_max"):
        assert abs(m[stat] - delta) <= gap["abs_logp_gap_max"] + bound(int(n) + 4) * delta
    assert m["routing_mismatch"] == 0.0  # routes untouched


def test_flipped_routes_give_hand_derived_rates():
    # In layer 1 of row 0, replace the second expert of every recorded token by one the
    # router did not choose: half of that token's top-2 set is wrong.
    params, _, _ = _setup()
    r = _rollout("exact")
    routes = np.array(r.routes_mu_BxSxLxK)
    rec_BxS = (routes >= 0).all(axis=(2, 3))
    row0 = np.nonzero(rec_BxS[0])[0]
    for s in row0:
        chosen = set(routes[0, s, 1])
        routes[0, s, 1, 1] = min(set(range(CFG.num_experts)) - chosen)
    m = measure_mismatch(params, r._replace(routes_mu_BxSxLxK=jnp.asarray(routes)), CFG)
    n = rec_BxS.sum()
    assert m["routed_tokens"] == n
    # Sums of n float32 halves / ones, then one division: exact up to n + 1 roundings.
    assert_close(m["routing_mismatch_per_layer"], [0.0, 0.5 * len(row0) / n], n=int(n) + 1)
    assert_close(m["routing_any_flip"], len(row0) / n, n=int(n) + 1)
    assert m["abs_logp_gap_max"] <= exact_tol(r)  # log-probs untouched


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
    hot = SamplingConfig(max_new_tokens=20, temperature=0.7)
    r = _rollout("exact", hot)
    # /0.7 adds one rounding to the chain: far inside the bound.
    assert measure_mismatch(params, r, CFG, temperature=0.7)["abs_logp_gap_max"] <= exact_tol(r)
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
    vs_bf16 = measure_mismatch(params, r, CFG, train_numerics=nx.numerics_preset("bf16"))
    assert vs_bf16["abs_logp_gap_mean"] < vs_train["abs_logp_gap_mean"]
