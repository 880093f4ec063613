"""The sampler's serving layout (SamplingConfig.layout='serve'): the decode loop's
weights resharded once per call (attention and embeddings replicated, experts spread
over every device, the FP8 engine's weights kept as e4m3 + scales) sample exactly what
the training layout samples, and its compiled decode loop gathers no weight, only
activations, on a 2×2×2 mesh of CPU devices."""
import functools

import aot_helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import hlo_loops
from stablerl_jax.sampling import rollout as ro

# 8 experts, one per device in the serving layout; vocab, widths and rows chosen so that
# no activation has the dims of a weight (the gather check recognizes weights by dims).
CFG = ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=24, max_seq_len=40,
                  moe_tile=8, expert_parallel=True)
B, P, N = 16, 10, 14
EOS, PAD = 2, 0


def _mesh():
    return sharding.make_mesh(2, 2, 2, devices=cpu_devices())


@functools.lru_cache(maxsize=None)
def _problem(dtype="float32"):
    cfg = CFG.replace(param_dtype=dtype, compute_dtype=dtype)
    params = tf.init_params(jax.random.key(0), cfg)
    prompts = jax.random.randint(jax.random.key(1), (B, P), 3, CFG.vocab_size)
    mask = jnp.arange(P)[None, :] >= ((jnp.arange(B) % 3) * 2)[:, None]
    return cfg, params, jnp.where(mask, prompts, PAD), mask


def _placed(cfg, params, prompts, mask, mesh):
    if mesh is None:
        return params, prompts, mask
    p_sh = sharding.tree_shardings(tf.param_logical_axes(cfg), params, mesh)
    return (jax.device_put(params, p_sh),
            *jax.device_put((prompts, mask), sharding.batch_sharding(mesh)))


@functools.lru_cache(maxsize=None)
def _compiled(layout, preset, dtype, on_mesh, max_batch=0):
    """(rollout, optimized HLO text) of one compiled sampler: each test's programs are
    compiled once and both run and read."""
    cfg, params, prompts, mask = _problem(dtype)
    mesh = _mesh() if on_mesh else None
    sampling = SamplingConfig(max_new_tokens=N, layout=layout, max_batch=max_batch)
    args = (*_placed(cfg, params, prompts, mask, mesh), jax.random.key(3))
    static = (cfg, sampling, nx.numerics_preset(preset), ro.stop_set(EOS), PAD, mesh)
    compiled = ro._sample.lower(*args, *static).compile()
    return compiled(*args), compiled.as_text()


@pytest.mark.parametrize("preset,dtype,on_mesh,max_batch", [
    ("fp8", "float32", True, 0),
    pytest.param("fp8", "float32", False, 0, marks=pytest.mark.slow),
    pytest.param("exact", "float64", True, 0, marks=pytest.mark.slow),
    pytest.param("fp8", "float32", True, 8, marks=pytest.mark.slow)])
def test_serve_layout_samples_what_the_train_layout_samples(x64, preset, dtype, on_mesh,
                                                            max_batch):
    # Bit for bit: the serving layout moves where the weights live, not what a matmul
    # sums (each row's attention is local either way; with top-2 a token's expert
    # output is the sum of two terms whichever shards hold them). The FP8 engine's
    # e4m3 + scale storage widens to the same bfloat16 values the train layout stores.
    # The one exception is the route weights' last bit: the two programs fuse the
    # top-k renormalization differently (a float reassociation of the compiler's).
    train, serve = (_compiled(lay, preset, dtype, on_mesh, max_batch)[0]
                    for lay in ("train", "serve"))
    assert int(jnp.sum(train.completion_mask_BxS)) > B  # rows decoded several tokens
    for name, a, b in zip(ro.Rollout._fields, train, serve):
        if name == "route_weights_mu_BxSxLxK":
            eps = float(jnp.finfo(jnp.dtype(a.dtype)).eps)
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2 * eps, atol=0)
        else:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def _decode_body(layout):
    # The programs of the fp8 equality test above (float32 params: under x64 the
    # float64 inputs would be another program).
    module = hlo_loops.Module(_compiled(layout, "fp8", "float32", True, 0)[1])
    loop = hlo_loops.decode_loop(module)
    assert loop.function == "_decode", loop  # found by its stack frame
    return module, loop


def test_serve_decode_loop_gathers_no_weight_and_moves_only_activations():
    gathered = {}
    for layout in ("train", "serve"):
        module, loop = _decode_body(layout)
        params_like = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), CFG))
        # The train layout splits the experts over the expert axis (2 shards).
        shapes = aot_helpers.weight_shapes(params_like, CFG.num_experts, 2)
        gathered[layout] = aot_helpers.param_gathers(module.instructions_under(loop.body),
                                                   shapes)
    # The train layout all-gathers its FSDP-sharded weights inside the decode loop
    # (so the check can see a gather); the serving layout gathers none.
    assert gathered["train"], "the train layout should gather weights per decode step"
    assert gathered["serve"] == [], gathered["serve"]
    # Tokens reach their experts by a ragged all-to-all (8 shards, top-2: fewer bytes
    # than gathering every shard's rows), not an all-gather + reduce-scatter of partial
    # outputs. XLA:CPU builds that exchange from an all-gather, so the bytes it moves
    # per decode step are checked on the TPU program (tests/pod/aot_test.py).
    kinds = {ins.collective for ins in module.instructions_under(loop.body)
             if ins.collective}
    assert "reduce-scatter" not in kinds, kinds


def test_serve_layout_needs_the_experts_to_split_over_every_device():
    from stablerl_jax import presets
    from stablerl_jax.config import ConfigError
    # 256 devices (micro-batches of 256 rows), 128 experts.
    big = ["mesh=1,32,8", "rl.microbatches=4", "sft.microbatches=1"]
    with pytest.raises(ConfigError, match="sampling.layout"):
        presets.preset("paper", big)
    # The training layout only needs the expert axis to divide them.
    assert presets.preset("paper", big + ["sampling.layout=train"]).mesh[1] == 32
