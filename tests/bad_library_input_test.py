"""Bad input handed to the library directly (tensors, loss batches, settings): each is
refused with an error that names the argument and says what to change; the companion of
tests/bad_input_test.py, tests/bad_file_input_test.py and
tests/interop/bad_hf_input_test.py (command line, data and files)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from rl_helpers import tiny_cfg

from stablerl_jax import input_checks, presets
from stablerl_jax.config import ConfigError, LossConfig
from stablerl_jax.method import losses
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import moe
from stablerl_jax.model import transformer as tf


def test_replay_tensors_name_shape_dtype_and_values():
    logits = jnp.zeros((3, 4))
    for replay, needle in [(jnp.zeros((3, 3), jnp.int32), "replay: shape"),
                           (jnp.zeros((3, 2), jnp.float32), "replay: dtype"),
                           (jnp.array([[0, 4], [1, 2], [0, 1]]), "values must be in"),
                           (jnp.array([[1, 1], [1, 2], [0, 1]]), "repeat an expert"),
                           (jnp.array([[-1, 2], [1, 2], [0, 1]]), "mix both")]:
        with pytest.raises(ValueError, match=needle):
            moe.route(logits, 2, replay)


def test_model_inputs_name_the_field():
    cfg = dataclasses.replace(tiny_cfg().model)
    params = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="replay: shape"):
        tf.forward(params, tokens, cfg, replay_BxTxLxK=jnp.zeros((2, 5, 1, 2), jnp.int32))
    # Host (numpy) ids are checked always; device arrays' values under checks=True.
    host = np.zeros((2, 5), np.int32)
    host[0, 0] = 99
    with pytest.raises(ValueError, match=r"vocab_size=64\), got min=0 max=99"):
        tf.forward(params, host, cfg)
    with pytest.raises(ValueError, match=r"vocab_size=64\), got min=0 max=99"):
        tf.forward(params, tokens.at[0, 0].set(99), cfg, checks=True)
    with pytest.raises(ValueError, match=r"got min=-1 max=0"):
        tf.forward(params, tokens.at[1, 4].set(-1), cfg, checks=True)
    with pytest.raises(ValueError, match="tokens: must be an integer"):
        tf.forward(params, tokens.astype(jnp.float32), cfg)
    with pytest.raises(ValueError, match=r"tokens: empty batch, shape \(0, 5\)"):
        tf.forward(params, jnp.zeros((0, 5), jnp.int32), cfg)
    with pytest.raises(ValueError, match="attention_mask: values must be 0 or 1, got min=1 "
                                         "max=2"):
        tf.forward(params, tokens, cfg, attention_mask_BxT=jnp.ones((2, 5), jnp.int32)
                   .at[0, 0].set(2), checks=True)


def test_value_checks_under_jit_through_checkify():
    cfg = tiny_cfg().model
    params = tf.init_params(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 6), jnp.int32)
    attn = jnp.ones((2, 6), bool)
    f = checkify.checkify(jax.jit(lambda p, t, a: policy_logprobs(p, t, a, cfg,
                                                                   checks=True)[0]))
    err, logp = f(params, tokens, attn)
    err.throw()  # valid inputs: no error
    assert logp.shape == (2, 5)
    err, _ = f(params, tokens.at[1, 3].set(64), attn)
    with pytest.raises(ValueError, match=r"tokens: ids must be in \[0, vocab_size=64\)"):
        err.throw()
    with pytest.raises(ValueError, match="attn_BxS: shape"):
        policy_logprobs(params, tokens, attn[:, :5], cfg)


def test_loss_batch_values_and_emptiness():
    logp = jnp.full((2, 3), -1.0)
    ok = losses.LossBatch(jnp.full((2, 3), -1.0), jnp.full((2, 3), -1.0), jnp.ones((2, 3)),
                          advantages_B=jnp.ones(2))
    with input_checks.checking():
        losses.minirl(logp, ok, LossConfig())  # valid: no error
        for m in (2.0, -1.0):
            with pytest.raises(ValueError, match="batch.mask_BxT: values must be 0 or 1"):
                losses.minirl(logp, ok._replace(mask_BxT=ok.mask_BxT.at[0, 1].set(m)),
                              LossConfig())
    empty = losses.LossBatch(jnp.zeros((0, 3)), jnp.zeros((0, 3)), jnp.ones((0, 3)),
                             advantages_B=jnp.zeros(0))
    with pytest.raises(ValueError, match=r"logp_BxT: empty batch, shape \(0, 3\)"):
        losses.minirl(jnp.zeros((0, 3)), empty, LossConfig())
    with pytest.raises(ValueError, match="batch.old_logp_BxT: dtype int32 must be floating"):
        losses.minirl(logp, ok._replace(old_logp_BxT=jnp.zeros((2, 3), jnp.int32)),
                      LossConfig())


def test_loss_inputs_of_mismatched_shapes():
    logp = jnp.zeros((2, 3))
    ok = losses.LossBatch(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)),
                          advantages_B=jnp.zeros(2))
    for bad, needle in [(ok._replace(mask_BxT=jnp.ones((2, 4))), "batch.mask_BxT: shape"),
                        (ok._replace(old_logp_BxT=jnp.zeros(3)), "batch.old_logp_BxT"),
                        (ok._replace(advantages_B=jnp.zeros(3)), "batch.advantages_B"),
                        (ok._replace(advantages_B=None), "advantages_B")]:
        with pytest.raises(ValueError, match=needle):
            losses.minirl(logp, bad, LossConfig())
    assert np.isfinite(float(losses.minirl(logp, ok, LossConfig())[0]))


def test_config_errors_are_config_errors():
    # One class of error for every setting, so a caller can catch them all at once.
    with pytest.raises(ConfigError):
        presets.preset("tiny", ["rl.steps=-1"])
