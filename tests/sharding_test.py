"""Sharded over a 2×2×2 mesh of fake CPU devices equals unsharded."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=32, max_seq_len=32,
                  moe_tile=8)


def test_rules_map_logical_axes():
    mesh = sharding.make_mesh(2, 2, 2)
    assert sharding.spec(("layers", "experts", "embed", "mlp"), (2, 8, 32, 32), mesh) == P(
        None, "expert", "fsdp", None)
    # A dim the mesh axis does not divide is replicated rather than failing to compile.
    assert sharding.spec(("embed",), (3,), mesh) == P(None)
    with pytest.raises(KeyError, match="'nonsense'"):
        sharding.spec(("nonsense",), (4,), mesh)
    with pytest.raises(ValueError, match="must equal the number of devices"):
        sharding.make_mesh(2, 2, 1)


def test_sharded_forward_and_grad_equal_unsharded():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
    params = tf.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (4, 10), 0, CFG.vocab_size)
    mask = jnp.ones((4, 10), bool).at[0, :3].set(False)
    probe = jax.random.normal(jax.random.key(2), (4, 10, CFG.d_model))

    def loss(p, t, m):
        h, aux = tf.forward(p, t, CFG, attention_mask_BxT=m)
        return jnp.sum(jnp.where(m[..., None], h * probe, 0)), aux["routes"]

    step = jax.value_and_grad(loss, has_aux=True)
    (v0, r0), g0 = jax.jit(step)(params, tokens, mask)

    mesh = sharding.make_mesh(2, 2, 2)
    p_sh = sharding.tree_shardings(tf.param_logical_axes(CFG), params, mesh)
    b_sh = sharding.batch_sharding(mesh, 2)
    sharded = jax.jit(step, in_shardings=(p_sh, b_sh, b_sh),
                      out_shardings=((sharding.replicated(mesh), sharding.routes_sharding(mesh)),
                                     p_sh))
    params_s = sharding.shard_params(params, tf.param_logical_axes(CFG), mesh)
    (v1, r1), g1 = sharded(params_s, jax.device_put(tokens, b_sh), jax.device_put(mask, b_sh))
    assert g1["layers"]["w_gate"].sharding.spec == P(None, "expert", "fsdp", None)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    np.testing.assert_array_equal(r1, r0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
