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


def test_ragged_all_to_all_on_cpu_follows_its_documented_semantics():
    """XLA:CPU has no ragged all-to-all; expert_parallel.ragged_all_to_all builds it from
    an all-gather there. Against the loop of lax.ragged_all_to_all's docstring, over two
    mesh axes at once, with gaps between the slices on both sides."""
    from jax.sharding import PartitionSpec as P

    from stablerl_jax.model import expert_parallel
    n, rows, out_rows, d = 4, 12, 20, 3
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 4, (n, n)).astype(np.int32)           # [sender, receiver]
    in_off = np.zeros((n, n), np.int32)                           # slices with gaps
    out_off = np.zeros((n, n), np.int32)
    for s in range(n):
        in_off[s] = np.cumsum(sizes[s] + 1) - sizes[s] - 1
    for r in range(n):
        out_off[:, r] = np.cumsum(sizes[:, r] + 1) - sizes[:, r]
    operand = rng.normal(size=(n, rows, d)).astype(np.float32)
    output = np.full((n, out_rows, d), -7.0, np.float32)
    want = output.copy()
    for s in range(n):
        for r in range(n):
            src = operand[s, in_off[s, r]:in_off[s, r] + sizes[s, r]]
            want[r, out_off[s, r]:out_off[s, r] + sizes[s, r]] = src

    mesh = jax.sharding.Mesh(np.array(cpu_devices(n)).reshape(2, 2), ("a", "b"))
    row = P(("a", "b"))
    fn = jax.shard_map(
        lambda *a: expert_parallel.ragged_all_to_all(*(x[0] for x in a),
                                                     axis_name=("a", "b"))[None],
        mesh=mesh, in_specs=row, out_specs=row)
    got = jax.jit(fn)(operand, output, in_off, sizes, out_off, sizes.T.copy())
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("num_experts,few", [(8, True), (16, False), (32, False)])
def test_decode_exchange_equals_the_gathered_tokens(x64, num_experts, few):
    """The decode step's ragged exchange (each assignment to its expert's shard and
    back) against the gather path, on the serving layout's 8 expert shards: 1 expert a
    shard (dense on the receiver), 2 and 4 (grouped). With top-2 a token's output is the
    sum of two terms either way, so the results are equal bit for bit."""
    from stablerl_jax.model import expert_parallel, moe
    cfg = CFG.replace(num_experts=num_experts, expert_parallel=True)
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    rules = sharding.serve_rules(True)
    params = tf.init_params(jax.random.key(0), cfg)["layers"]
    ws = [p[0] for p in (params["w_gate"], params["w_up"], params["w_down"])]
    tokens = 16
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.d_model), jnp.float64)
    logits = jax.random.normal(jax.random.key(2), (tokens, num_experts))
    idx, w, _ = moe.route(logits.at[:, 0].add(3.0), cfg.top_k)   # expert 0 is popular
    fn = lambda *a, **k: moe.experts_grouped(*a, tile=cfg.moe_tile, **k)
    out = {}
    for exchange in (False, True):
        run = expert_parallel.sharded_experts(
            fn, mesh, cfg, rules, exchange=exchange,
            few_experts_fn=moe.experts_local_dense if few else None)
        out[exchange] = np.asarray(jax.jit(run)(x, idx, w, *ws))
    np.testing.assert_array_equal(out[True], out[False])
    # Against the dense reference: the roundings of one expert FFN, gate/up (D), SwiGLU,
    # down (F) and the combine (K), norm-wise (the down projection's sum may cancel).
    ref = moe.experts_dense(x, idx, w, *ws)
    assert_close(out[True], ref, n=cfg.d_model + cfg.expert_ffn_dim + cfg.top_k + 8,
                 dtype="float64", scale="max")
