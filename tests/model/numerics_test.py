"""Numerics presets: exact == train, FP8 rounding is real e4m3, knobs add mismatch."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax.config import ConfigError, ModelConfig
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from tolerance import assert_close

# Dense dispatch: the numerics do not depend on the dispatch path (tested equal elsewhere)
# and the dense graph compiles faster.
CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=32,
                  dispatch="dense")


def test_fake_quant_values_are_e4m3_times_channel_scale():
    w = jax.random.normal(jax.random.key(0), (16, 8))
    q = nx.fake_quant_e4m3(w, (0,))
    scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / nx.E4M3_MAX
    units = q / scale
    # q / scale recovers e4m3 values up to two float32 roundings: q = e4m3 · scale, and
    # the division itself (scale is computed as the library computes it: bit for bit).
    assert_close(units.astype(jnp.float8_e4m3fn).astype(jnp.float32), units, n=2)
    assert_close(jnp.max(jnp.abs(units), axis=0), nx.E4M3_MAX, n=2)
    rel = jnp.abs(q - w) / jnp.abs(w).max(0)
    assert 0 < float(rel.max()) < 2**-3  # e4m3: 3 mantissa bits


@functools.partial(jax.jit, static_argnums=0)
def _forward(numerics, params, tokens):
    return tf.forward(nx.prepare_params(params, numerics), tokens, CFG, numerics=numerics)


def test_exact_is_train_and_presets_order_the_error():
    params = tf.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    ref, aux = _forward(nx.numerics_preset("train"), params, tokens)
    out = {p: _forward(nx.numerics_preset(p), params, tokens) for p in ("exact", "bf16", "fp8")}
    np.testing.assert_array_equal(out["exact"][0], ref)
    err = {p: float(jnp.abs(h.astype(jnp.float32) - ref).mean()) for p, (h, _) in out.items()}
    assert err["exact"] == 0.0 < err["bf16"] < err["fp8"]
    flips = {p: float((a["routes"] != aux["routes"]).mean()) for p, (_, a) in out.items()}
    assert flips["exact"] == 0.0 and flips["fp8"] > 0.0


def test_knobs_increase_mismatch():
    params = tf.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    ref, aux = _forward(nx.numerics_preset("train"), params, tokens)
    base, _ = _forward(nx.numerics_preset("fp8"), params, tokens)
    act, _ = _forward(nx.numerics_preset("fp8", act_fp8=True), params, tokens)
    err = lambda h: float(jnp.abs(h.astype(jnp.float32) - ref).mean())
    assert err(act) > err(base)
    # Router noise on the exact preset (0 flips without it) flips routes.
    exact, exact_aux = _forward(nx.numerics_preset("exact"), params, tokens)
    noisy_h, noisy = _forward(nx.numerics_preset("exact", router_noise_std=0.3), params, tokens)
    flip = lambda a: float((a["routes"] != aux["routes"]).mean())
    assert flip(exact_aux) == 0.0 < flip(noisy)
    assert err(exact) == 0.0 < err(noisy_h)
    # Same seed, same noise: deterministic.
    _, again = _forward(nx.numerics_preset("exact", router_noise_std=0.3), params, tokens)
    np.testing.assert_array_equal(again["routes"], noisy["routes"])


def test_prepare_params_converts_once_per_preset():
    params = tf.init_params(jax.random.key(0), CFG)
    assert nx.prepare_params(params, nx.numerics_preset("exact")) is params
    bf16 = nx.prepare_params(params, nx.numerics_preset("bf16"))
    fp8 = nx.prepare_params(params, nx.numerics_preset("fp8"))
    for tree in (bf16, fp8):
        assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(tree))
    # Only the quantized matmul weights differ from plain bf16; embedding, router and
    # norms stay bf16, as FP8 inference engines keep them.
    for name in params["layers"]:
        same = bool(jnp.array_equal(fp8["layers"][name], bf16["layers"][name]))
        assert same == (name not in nx._QUANT_AXES), name
    np.testing.assert_array_equal(fp8["embed"], bf16["embed"])
    # Each fp8 weight is an e4m3 value times its per-output-channel scale (up to the
    # bf16 rounding of that product: one bfloat16 rounding).
    w = params["layers"]["w_up"].astype(jnp.float32)
    q = nx.fake_quant_e4m3(w, (2,))
    assert_close(fp8["layers"]["w_up"].astype(jnp.float32), q, n=1, dtype="bfloat16")
    # Overriding a knob builds a new value and leaves the preset table alone.
    assert nx.numerics_preset("fp8", act_fp8=True).act_fp8
    assert not nx.NUMERICS_PRESETS["fp8"].act_fp8


def test_kept_quantized_weights_widen_to_the_same_bits():
    """keep_quantized stores e4m3 values + scales (1 byte a value) that `dequantize`
    turns into the bits the widened form holds; `store_fp8=` is its deprecated name."""
    params = tf.init_params(jax.random.key(0), CFG)
    fp8 = nx.numerics_preset("fp8")
    kept = nx.prepare_params(params, fp8, keep_quantized=True)
    wide = nx.prepare_params(params, fp8)
    for name, w in kept["layers"].items():
        assert nx.is_quantized(w) == (name in nx._QUANT_AXES), name
        assert nx.axes_like(w, ("a",)) == ({"values": ("a",), "scale": ("a",)}
                                           if nx.is_quantized(w) else ("a",))
        np.testing.assert_array_equal(nx.dequantize(w), wide["layers"][name])
    assert kept["layers"]["w_up"]["values"].dtype == jnp.float8_e4m3fn
    with pytest.warns(DeprecationWarning, match="keep_quantized"):
        old = nx.prepare_params(params, fp8, store_fp8=True)
    assert jax.tree.all(jax.tree.map(np.array_equal, old, kept))


def test_validation():
    with pytest.raises(ValueError, match="unknown 'int4'"):
        nx.numerics_preset("int4")
    with pytest.raises(ConfigError, match="^weights:"):
        nx.Numerics(weights="int4")
    with pytest.raises(ConfigError, match="^router_noise_std:"):
        nx.Numerics(router_noise_std=-1.0)
    with pytest.raises(ConfigError, match="^compute_dtype:"):
        nx.Numerics(compute_dtype="int8")
