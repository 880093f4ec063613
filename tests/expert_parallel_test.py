"""The expert FFN under shard_map on a 2×2×2 mesh of CPU devices: expert parallel and
gathered experts both equal the unsharded model in value and gradient (float64: the
test is about the sharded program's math), and with expert parallelism the compiled HLO
never gathers an expert weight across the `expert` axis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aot_helpers import expert_weight_gathers
from conftest import cpu_devices
from tolerance import assert_close, backward_chain, forward_chain

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=24, max_seq_len=32,
                  moe_tile=8, param_dtype="float64", compute_dtype="float64")
B, T = 8, 10


def _problem():
    params = tf.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    mask = jnp.ones((B, T), bool).at[0, :3].set(False)
    probe = jax.random.normal(jax.random.key(2), (B, T, CFG.d_model), jnp.float64)
    return params, tokens, mask, probe


def _step(cfg, mesh, probe):
    def loss(p, t, m):
        h, aux = tf.forward(p, t, cfg, attention_mask_BxT=m, mesh=mesh)
        return jnp.sum(jnp.where(m[..., None], h * probe, 0)), aux["routes"]
    return jax.value_and_grad(loss, has_aux=True)


def _sharded(cfg, params, tokens, mask, probe):
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    p_sh = sharding.tree_shardings(tf.param_logical_axes(cfg), params, mesh)
    b_sh = sharding.batch_sharding(mesh)
    fn = jax.jit(_step(cfg, mesh, probe), in_shardings=(p_sh, b_sh, b_sh),
                 out_shardings=((sharding.replicated(mesh), b_sh), p_sh))
    args = (jax.device_put(params, p_sh), jax.device_put(tokens, b_sh),
            jax.device_put(mask, b_sh))
    return fn, args


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_sharded_experts_equal_unsharded(x64, expert_parallel):
    cfg = CFG.replace(expert_parallel=expert_parallel)
    params, tokens, mask, probe = _problem()
    (v0, r0), g0 = jax.jit(_step(cfg, None, probe))(params, tokens, mask)
    fn, args = _sharded(cfg, params, tokens, mask, probe)
    (v1, r1), g1 = fn(*args)
    np.testing.assert_array_equal(r1, r0)
    # The value sums B·T·D probe terms; a weight gradient sums over the B·T tokens, which
    # may cancel to one token's term (cond B·T), as in tests/sharding_test.py.
    assert_close(v1, v0, n=forward_chain(CFG, T) + B * T * CFG.d_model, dtype="float64",
                 scale=float(jnp.sum(jnp.abs(jnp.where(mask[..., None], probe, 0)))))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert_close(a, b, n=backward_chain(CFG, T, B * T), dtype="float64", cond=B * T,
                     scale="max")


def test_expert_parallel_never_gathers_expert_weights_over_the_expert_axis(x64):
    """Compiled forward + backward: with expert parallelism no all-gather yields all E
    experts of a weight (each device keeps its E/2, gathered over fsdp only); the
    gathered-experts layout does gather them, so the check can see it."""
    params, tokens, mask, probe = _problem()
    counts = {}
    for ep in (True, False):
        fn, args = _sharded(CFG.replace(expert_parallel=ep), params, tokens, mask, probe)
        counts[ep] = expert_weight_gathers(fn.lower(*args).compile().as_text(),
                                           CFG.num_experts, CFG.expert_ffn_dim)
    assert counts[True] == [], counts[True]
    assert counts[False], "the gathered layout should all-gather every expert's weights"
