"""Sharded over a 2×2×2 mesh of fake CPU devices equals unsharded (in float64: the test is
about the math of the sharded program, not its float32 summation order)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from jax.sharding import PartitionSpec as P
from tolerance import assert_close, backward_chain, forward_chain

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=32,
                  moe_tile=8, param_dtype="float64", compute_dtype="float64")
B, T = 8, 10  # B: a multiple of the 8 devices the batch is split over


def test_rules_map_logical_axes():
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    assert sharding.spec(("layers", "experts", "embed", "mlp"), (2, 8, 32, 32), mesh) == P(
        None, "expert", "fsdp", None)
    # A dim the mesh axis does not divide is replicated rather than failing to compile.
    assert sharding.spec(("embed",), (3,), mesh) == P(None)
    with pytest.raises(KeyError, match="'nonsense'"):
        sharding.spec(("nonsense",), (4,), mesh)
    with pytest.raises(ValueError, match="must equal the number of devices"):
        sharding.make_mesh(2, 2, 1, devices=cpu_devices())


def test_sharded_forward_and_grad_equal_unsharded(x64):
    params = tf.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    mask = jnp.ones((B, T), bool).at[0, :3].set(False)
    probe = jax.random.normal(jax.random.key(2), (B, T, CFG.d_model), jnp.float64)

    def loss(p, t, m):
        h, aux = tf.forward(p, t, CFG, attention_mask_BxT=m)
        return jnp.sum(jnp.where(m[..., None], h * probe, 0)), aux["routes"]

    step = jax.value_and_grad(loss, has_aux=True)
    (v0, r0), g0 = jax.jit(step)(params, tokens, mask)

    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    p_sh = sharding.tree_shardings(tf.param_logical_axes(CFG), params, mesh)
    b_sh = sharding.batch_sharding(mesh)  # every batch leaf, routes [B, T, L, K] included
    sharded = jax.jit(step, in_shardings=(p_sh, b_sh, b_sh),
                      out_shardings=((sharding.replicated(mesh), b_sh), p_sh))
    params_s = jax.device_put(params, p_sh)
    (v1, r1), g1 = sharded(params_s, jax.device_put(tokens, b_sh), jax.device_put(mask, b_sh))
    assert g1["layers"]["w_gate"].sharding.spec == P(None, "expert", "fsdp", None)
    # The value sums B·T·D probe terms of random sign (cond measured below); a weight
    # gradient sums over the B·T tokens, which may cancel to one token's term (cond B·T).
    h0 = jax.jit(lambda p: tf.forward(p, tokens, CFG, attention_mask_BxT=mask)[0])(params)
    terms = np.where(np.asarray(mask)[..., None], np.asarray(h0 * probe), 0)
    cond = float(np.abs(terms).sum() / abs(terms.sum()))
    assert_close(v1, v0, n=forward_chain(CFG, T) + B * T * CFG.d_model, dtype="float64",
                 cond=cond)
    np.testing.assert_array_equal(r1, r0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, n=backward_chain(CFG, T, B * T), dtype="float64", cond=B * T,
                     scale="max")
