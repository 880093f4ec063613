"""Decode attention (kernels/decode_attention*.py): every row of DECODE_IMPLS runnable
here against the reference "blocks", rows at different slots; the ragged kernel reads
each row's own key blocks and nothing past them; through the model, the samplers return
the same responses with the kernel as with the reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from kernel_cases import INTERPRET, impl_params

from stablerl_jax import sharding
from stablerl_jax.config import ConfigError, ModelConfig, SamplingConfig
from stablerl_jax.kernels import decode_attention_pallas
from stablerl_jax.kernels.decode_attention import blocks, decode_attention
from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS, DecodeImpl
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as ro

B, KV, G, DH, S, L, X = 5, 2, 4, 16, 44, 3, 8  # S not a multiple of X: a last block overlaps


def _inputs(dtype=jnp.float32, stacked=True):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, KV, G, DH), jnp.float32).astype(dtype)
    shape = (L, B, KV, S, DH) if stacked else (B, KV, S, DH)
    k, v = (jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in ks[1:])
    # Left padding of 0, 3 and 9 slots; row 4's only key slot is padding (no real key).
    pad = jnp.array([0, 3, 9, 0, 5])
    mask = jnp.arange(S)[None, :] >= pad[:, None]
    last = jnp.array([5, 43, 17, 0, 4], jnp.int32)
    return q, k, v, mask, last


def _tolerance(dtype, scale):
    """Each output is Σ_x p_x v_x / Σ_x p_x after q·k dot products of Dh terms: blocks
    summed in another order differ by at most ~(Dh + S)·u of the largest |v| (the
    standard dot-product bound γ_n ≤ n·u), u the unit roundoff of `dtype` (the ops run
    in float32 with `dtype` operands rounded the same way in both)."""
    return (DH + S) * float(jnp.finfo(jnp.float32).eps) * scale


@pytest.mark.parametrize("impl", impl_params(DECODE_IMPLS))
@pytest.mark.parametrize("stacked", [True, False])
def test_every_row_is_the_reference(impl, stacked):
    q, k, v, mask, last = _inputs(stacked=stacked)
    layer = jnp.int32(1) if stacked else None
    ref = blocks(q, k, v, mask, last, block=X, layer=layer)
    out = decode_attention(q, k, v, mask, last, block=X, layer=layer, impl=impl,
                           interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0,
                               atol=_tolerance(jnp.float32, float(jnp.abs(v).max())))
    assert not np.asarray(out[4]).any(), "a row with no real key gives zeros"
    # A scalar slot (every row at the same slot, the static sampler's left-padded rows).
    ref = blocks(q, k, v, mask, 20, block=X, layer=layer)
    out = decode_attention(q, k, v, mask, 20, block=X, layer=layer, impl=impl,
                           interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0,
                               atol=_tolerance(jnp.float32, float(jnp.abs(v).max())))


@pytest.mark.parametrize("impl", impl_params(DECODE_IMPLS))
def test_bfloat16_operands(impl):
    q, k, v, mask, last = _inputs(jnp.bfloat16)
    ref = blocks(q, k, v, mask, last, block=X, layer=jnp.int32(2))
    out = decode_attention(q, k, v, mask, last, block=X, layer=jnp.int32(2), impl=impl,
                           interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    # Both round p to bfloat16 before p·v and the output to bfloat16: one bf16 ulp of
    # the output's scale on top of the float32 bound.
    atol = float(jnp.finfo(jnp.bfloat16).eps) * float(jnp.abs(v.astype(jnp.float32)).max())
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=0, atol=2 * atol)


@pytest.mark.parametrize("impl", impl_params(DECODE_IMPLS, lambda _, row: row.ragged))
def test_the_ragged_kernel_reads_only_each_rows_own_blocks(impl):
    """NaN in every cache slot past each row's last block: the reference, which reads
    every row up to the largest row's block, turns the short rows to NaN (0 · NaN in
    p·v); the ragged kernel never reads them and gives the clean cache's output. The
    interpreter also raises on a read outside the arrays."""
    q, k, v, mask, last = _inputs()
    block_end = (last // X + 1) * X  # first slot past each row's last block
    past = jnp.arange(S)[None, :] >= block_end[:, None]  # [B, S]
    poison = lambda c: jnp.where(past[None, :, None, :, None], jnp.nan, c)
    kp, vp = poison(k), poison(v)
    assert np.isnan(np.asarray(blocks(q, kp, vp, mask, last, block=X,
                                      layer=jnp.int32(0)))[0]).all()
    out = decode_attention(q, kp, vp, mask, last, block=X, layer=jnp.int32(0), impl=impl,
                           interpret=INTERPRET)
    ref = blocks(q, k, v, mask, last, block=X, layer=jnp.int32(0))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0,
                               atol=_tolerance(jnp.float32, float(jnp.abs(v).max())))


def test_the_kernel_needs_a_blocked_head_major_cache():
    base = ModelConfig(decode_block=8, kv_cache_layout="bksd")
    assert base.replace(decode_attention_impl="pallas_tpu").decode_attention_impl == "pallas_tpu"
    for bad in (dict(decode_block=0), dict(kv_cache_layout="bskd")):
        with pytest.raises(ConfigError, match="decode_attention_impl: .*kv_cache_layout=bksd"):
            base.replace(decode_attention_impl="pallas_tpu", **bad)
    with pytest.raises(ConfigError, match="decode_attention_impl: must be one of"):
        base.replace(decode_attention_impl="paged")


# Through the model: a Pallas row that runs the TPU kernel in the interpreter (the model
# loads Pallas rows compiled; this one interprets whatever it is told), registered for
# these tests.
def interpreted_kernel(*args, interpret=False, **kw):
    del interpret
    return decode_attention_pallas.pallas(*args, target="tpu", interpret=True, **kw)


CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64, max_seq_len=40,
                  moe_tile=16, kv_cache_layout="bksd", decode_block=8)
EOS, PAD = 2, 0


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setitem(DECODE_IMPLS, "pallas_tpu_interpreted", DecodeImpl(
        f"{__name__}:interpreted_kernel", ("cpu",), pallas=True, ragged=True))
    return "pallas_tpu_interpreted"


@functools.lru_cache(maxsize=None)
def _model_inputs():
    params = tf.init_params(jax.random.key(0), CFG)
    params["unembed"] = params["unembed"].at[0, EOS].add(3.0)  # lengths spread over [1, C]
    prompts = jax.random.randint(jax.random.key(1), (8, 12), 3, CFG.vocab_size)
    mask = jnp.arange(12)[None, :] >= ((jnp.arange(8) % 4) * 3)[:, None]
    return params, jnp.where(mask, prompts, PAD), mask


@pytest.mark.parametrize("sampler", ["static", "continuous"])
def test_the_samplers_draw_the_same_responses_with_the_kernel(interpreted, sampler):
    """FP8 sampling (the engine RL samples with) with the ragged kernel: the reference's
    responses, μ and routes bit for bit, the continuous sampler's rows at different
    slots included."""
    params, prompts, mask = _model_inputs()
    sampling = SamplingConfig(max_new_tokens=16, max_batch=4)
    run = ro.sample if sampler == "static" else continuous.sample
    out = {impl: run(params, prompts, mask, jax.random.key(5),
                     CFG.replace(decode_attention_impl=impl), sampling,
                     nx.numerics_preset("fp8"), eos_id=EOS, pad_id=PAD)
           for impl in ("blocks", interpreted)}
    lengths = np.asarray(out["blocks"].lengths_B)
    assert len(set(lengths.tolist())) > 2, "the test needs rows at different slots"
    for name, x, y in zip(out["blocks"]._fields, out["blocks"], out[interpreted]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def test_on_a_mesh_each_device_runs_the_kernel_on_its_own_rows(interpreted):
    """The serving layout on a 2 × 2 × 2 mesh of CPU devices (one row per device, the
    experts over every axis): the kernel runs under shard_map on each device's rows and
    cache, and the rollout is the reference's."""
    cfg = CFG.replace(expert_parallel=True)
    params, prompts, mask = _model_inputs()
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    params = jax.device_put(params, sharding.tree_shardings(tf.param_logical_axes(cfg),
                                                            params, mesh))
    prompts, mask = jax.device_put((prompts, mask), sharding.batch_sharding(mesh))
    sampling = SamplingConfig(max_new_tokens=12, layout="serve")
    out = [ro.sample(params, prompts, mask, jax.random.key(5),
                     cfg.replace(decode_attention_impl=impl), sampling,
                     nx.numerics_preset("fp8"), eos_id=EOS, pad_id=PAD, mesh=mesh)
           for impl in ("blocks", interpreted)]
    for name, x, y in zip(out[0]._fields, *out):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def test_the_preflight_refuses_the_tpu_kernel_on_another_platform():
    """`--preset paper --layout preset` on a CPU: one line naming the field and the fix,
    before any work."""
    from stablerl_jax import presets
    from stablerl_jax.rl import preflight
    cfg = presets.preset("paper", ["mesh=1,1,1", "model.gmm_impl=loop"])
    with pytest.raises(ConfigError, match="model.decode_attention_impl='pallas_tpu' compiles "
                       "for tpu only, not cpu: set model.decode_attention_impl=blocks"):
        preflight.check_kernels(cfg, cpu_devices()[:1])
    preflight.check_kernels(
        presets.preset("paper", ["mesh=1,1,1", "model.gmm_impl=loop",
                                 "model.decode_attention_impl=blocks"]), cpu_devices()[:1])
