"""The sampling path: exactness of the 'exact' preset, mismatch ordering, EOS, invariance."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax import rollout as ro
from stablerl_jax.config import ConfigError, ModelConfig
from stablerl_jax.mismatch import measure_mismatch
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64, max_seq_len=48,
                  moe_tile=16)
SAMPLING = ro.SamplingConfig(max_new_tokens=24, eos_id=2, pad_id=0)


@functools.lru_cache(maxsize=None)
def _setup(b=16):
    params = tf.init_params(jax.random.key(0), CFG)
    prompts = jax.random.randint(jax.random.key(1), (b, 12), 3, CFG.vocab_size)
    lengths = 12 - (jnp.arange(b) % 4) * 3  # left padding of 0, 3, 6, 9 slots
    mask = jnp.arange(12)[None, :] >= (12 - lengths)[:, None]
    return params, jnp.where(mask, prompts, 0), mask


@functools.lru_cache(maxsize=None)
def _rollout(preset, seed=2):
    params, prompts, mask = _setup()
    return ro.sample(params, prompts, mask, jax.random.key(seed), CFG, SAMPLING,
                     nx.preset(preset))


def test_exact_preset_matches_training_path():
    params, _, _ = _setup()
    r = _rollout("exact")
    m = measure_mismatch(params, r, CFG)
    assert m["abs_logp_gap_max"] <= 1e-5
    assert m["routing_mismatch"] == 0.0 and m["routing_any_flip"] == 0.0
    # Directly: the training forward's routes equal routes_mu wherever recorded.
    real = r.prompt_mask_BxS | r.completion_mask_BxS
    _, aux = tf.forward(params, r.tokens_BxS, CFG, attention_mask_BxT=real)
    rec = r.routes_mu_LxBxSxK >= 0
    assert int(rec.sum()) > 0
    np.testing.assert_array_equal(jnp.where(rec, aux["routes"], -1), r.routes_mu_LxBxSxK)


def test_mismatch_is_ordered_exact_bf16_fp8():
    params, _, _ = _setup()
    m = {p: measure_mismatch(params, _rollout(p), CFG) for p in ("exact", "bf16", "fp8")}
    assert m["exact"]["kl_k3"] < m["bf16"]["kl_k3"] < m["fp8"]["kl_k3"]
    assert m["exact"]["abs_logp_gap_mean"] < m["bf16"]["abs_logp_gap_mean"] < \
        m["fp8"]["abs_logp_gap_mean"]
    assert m["exact"]["routing_mismatch"] <= m["bf16"]["routing_mismatch"] < \
        m["fp8"]["routing_mismatch"]
    assert m["fp8"]["routing_any_flip"] > 0  # fp8 flips some routes


def test_keys_determine_samples():
    a, b = _rollout("exact", 2), _rollout("exact", 2)
    np.testing.assert_array_equal(a.tokens_BxS, b.tokens_BxS)
    c = _rollout("exact", 3)
    assert not np.array_equal(a.tokens_BxS, c.tokens_BxS)


def test_eos_rows_stop_and_are_masked():
    r = _rollout("exact")
    p = 12
    comp = np.asarray(r.completion_mask_BxS)
    toks = np.asarray(r.tokens_BxS)
    stopped = 0
    for b in range(toks.shape[0]):
        eos = np.where(toks[b, p:] == SAMPLING.eos_id)[0]
        n = int(r.lengths_B[b])
        if len(eos):
            stopped += 1
            assert n == eos[0] + 1  # EOS is the last completion token
            assert (toks[b, p + n:] == SAMPLING.pad_id).all()
            assert (np.asarray(r.routes_mu_LxBxSxK)[:, b, p + n - 1:] == -1).all()
        else:
            assert n == SAMPLING.max_new_tokens
        assert comp[b, p:p + n].all() and not comp[b, p + n:].any()
        assert (np.asarray(r.logp_mu_BxS)[b, p + n:] == 0).all()
        assert (np.asarray(r.logp_mu_BxS)[b, p:p + n] < 0).all()
    assert stopped > 0, "fixture should contain EOS-terminated rows"
    # The last sampled token of a full-length row is never fed back.
    assert (np.asarray(r.routes_mu_LxBxSxK)[:, :, -1] == -1).all()


def test_rows_are_batch_invariant():
    params, prompts, mask = _setup()
    keys = jax.random.split(jax.random.key(7), 4)
    batch = ro.sample(params, prompts[:4], mask[:4], keys, CFG, SAMPLING, nx.preset("exact"))
    for i in range(4):
        alone_p = prompts[i:i + 1, 12 - int(mask[i].sum()):]  # no padding at all
        alone = ro.sample(params, alone_p, jnp.ones_like(alone_p, bool), keys[i:i + 1], CFG,
                          SAMPLING, nx.preset("exact"))
        np.testing.assert_array_equal(alone.tokens_BxS[0, alone_p.shape[1]:],
                                      batch.tokens_BxS[i, 12:])
        np.testing.assert_allclose(alone.logp_mu_BxS[0, alone_p.shape[1]:],
                                   batch.logp_mu_BxS[i, 12:], atol=1e-5)


def test_truncation_support():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    lp = ro.sampling_logprobs(logits, ro.SamplingConfig(top_k=2))
    np.testing.assert_allclose(jnp.exp(lp), [[0.625, 0.375, 0, 0]], rtol=1e-6)
    lp = ro.sampling_logprobs(logits, ro.SamplingConfig(top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    np.testing.assert_allclose(jnp.exp(lp), [[0.625, 0.375, 0, 0]], rtol=1e-6)
    lp = ro.sampling_logprobs(logits, ro.SamplingConfig(temperature=0.5))
    np.testing.assert_allclose(jnp.exp(lp), jax.nn.softmax(logits / 0.5), rtol=1e-6)


def test_invalid_inputs_name_the_field():
    params, prompts, mask = _setup()
    with pytest.raises(ValueError, match="max_seq_len=48"):
        ro.sample(params, prompts, mask, jax.random.key(0), CFG,
                  ro.SamplingConfig(max_new_tokens=40), nx.preset("exact"))
    with pytest.raises(ConfigError, match="^max_new_tokens:"):
        ro.SamplingConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="^temperature:"):
        ro.SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="unknown 'fp4'"):
        nx.preset("fp4")
    with pytest.raises(ValueError, match="left-padded"):
        ro.sample(params, prompts, mask[:, ::-1], jax.random.key(0), CFG, SAMPLING,
                  nx.preset("exact"))
