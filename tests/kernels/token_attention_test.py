"""The per-token attention kernel (decode_attention_pallas.tokens, the `tokens` of
DECODE_IMPLS' "pallas_tpu"), which both engines run under batch-invariant numerics: a
query's output is fixed by its query and its sequence's keys, whatever cache, start
slot, companions and call it is in; through the model, the samplers record the trainer's
log-probs bit for bit with it."""
import dataclasses
import functools

import bitwise_helpers as bw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import tiny_cfg

from stablerl_jax.kernels import Impl, decode_attention_pallas
from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS
from stablerl_jax.model import invariant
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as ro

KV, G, DH, T, X = 2, 3, 16, 45, 8  # T positions: 6 blocks of X, the last one partial


def tokens(*args, interpret=False, **kw):
    """The kernel as a row's `tokens`: compiled by Mosaic on a TPU, in the TPU
    interpreter on any other backend (the kernel is built for TPU only)."""
    del interpret
    return decode_attention_pallas.tokens(*args, target="tpu",
                                          interpret=jax.default_backend() != "tpu", **kw)


def _sequence(dtype, seed=0):
    """One sequence's keys and values [KV, T, Dh], a query per position [T, KV, G, Dh],
    and its key mask (position 20 masked, as a hole a packed row's mask never has but
    the kernel must honour)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    k, v = (jax.random.normal(kk, (KV, T, DH)).astype(dtype) for kk in ks[:2])
    q = jax.random.normal(ks[2], (T, KV, G, DH)).astype(dtype)
    return k, v, q, jnp.arange(T) != 20


def _cache(seq, s, start, rows, row, seed=1):
    """A [rows, KV, s, Dh] cache holding `seq` in row `row` from slot `start`, every
    other slot random and marked real (so a read outside the sequence would show)."""
    k, v, _, mask = seq
    noise = jax.random.normal(jax.random.key(seed), (2, rows, KV, s, DH)).astype(k.dtype)
    kc = noise[0].at[row, :, start:start + T].set(k)
    vc = noise[1].at[row, :, start:start + T].set(v)
    mc = jnp.ones((rows, s), bool).at[row, start:start + T].set(mask)
    return kc, vc, mc


def _reference(seq, pos):
    """softmax(q kᵀ / √Dh) v in float64 over the real keys at positions ≤ pos."""
    k, v, q, mask = (np.asarray(a, np.float64) for a in seq)
    sc = np.einsum("kgd,ktd->kgt", q[pos], k[:, :pos + 1]) * DH ** -0.5
    sc = np.where(mask[:pos + 1].astype(bool), sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    return np.einsum("kgt,ktd->kgd", p / p.sum(-1, keepdims=True), v[:, :pos + 1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_querys_output_is_the_same_in_any_call(dtype):
    """The sequence's queries, all at once and one at a time, in caches of 64 and 96
    slots at start slots 0, 27 (a layer of a stacked cache) and 19 (where its last block
    runs past the cache's end and is copied from the cache's last window), beside other
    rows and other queries,
    and in the training forward's layout (`invariant.attend` pads its keys): every
    output's bits are the same, and within rounding of the float64 softmax."""
    seq = _sequence(dtype)
    q = seq[2]
    pos = jnp.arange(T, dtype=jnp.int32)
    outs = []
    for s, start, rows, row, layer in [(64, 0, 1, 0, None), (96, 27, 3, 2, 1),
                                       (64, 19, 2, 1, None)]:
        kc, vc, mc = _cache(seq, s, start, rows, row)
        if layer is not None:  # layer 1 of a stacked cache whose layer 0 is other keys
            kc, vc = (jnp.stack([c[::-1], c]) for c in (kc, vc))
        call = lambda q, p, r, st: tokens(q, p, r, st, kc, vc, mc, block=X, layer=layer)
        full = call(q, pos, jnp.full((T,), row), jnp.full((T,), start))
        outs.append(np.asarray(full))
        # Reversed, beside a query of another row, one at a time.
        other = jnp.concatenate([q[::-1], q[:1]])
        mixed = call(other, jnp.concatenate([pos[::-1], pos[:1] + 3]),
                     jnp.concatenate([jnp.full((T,), row), jnp.array([(row + 1) % rows])]),
                     jnp.concatenate([jnp.full((T,), start), jnp.array([0])]))
        outs.append(np.asarray(mixed[:T][::-1]))
        for p in (0, 8, 44):
            one = call(q[p:p + 1], pos[p:p + 1], jnp.array([row]), jnp.array([start]))
            assert np.array_equal(np.asarray(one[0]), outs[0][p]), (s, start, p)
    k, v, _, mask = seq
    trainer = invariant.attend(
        q.reshape(T, KV * G, DH), pos, jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32),
        jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None], mask[None], kv_heads=KV,
        dtype=dtype, keys="bskd", kernel=functools.partial(invariant.kernel_attend, tokens, X))
    outs.append(np.asarray(trainer).reshape(T, KV, G, DH))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    # Rounding: p·v over at most T terms and q·k over Dh, float32 accumulation, the
    # operands and the output rounded to `dtype` (one ulp of the largest |v|).
    u = float(jnp.finfo(dtype).eps)
    bound = (DH + T) * float(jnp.finfo(jnp.float32).eps) + 2 * u
    vmax = float(jnp.abs(v.astype(jnp.float32)).max())
    for p in range(T):
        np.testing.assert_allclose(outs[0][p].astype(np.float64), _reference(seq, p),
                                   rtol=0, atol=bound * vmax, err_msg=str(p))


def test_the_kernel_wants_whole_tiles_of_slots():
    """A cache the kernel cannot copy whole tiles of is refused, and `cache_slots` (what
    init_cache allocates under the kernel) is the smallest one it takes."""
    seq = _sequence(jnp.float32)
    assert decode_attention_pallas.cache_slots(45, X) == 64
    assert decode_attention_pallas.cache_slots(100, X) == 128
    assert decode_attention_pallas.cache_slots(900, 512) == 928
    kc, vc, mc = _cache(seq, 50, 0, 1, 0)
    with pytest.raises(ValueError, match="50 key slots; the kernel needs a multiple of 32"):
        tokens(seq[2][:1], jnp.array([0]), jnp.array([0]), jnp.array([0]), kc, vc, mc,
               block=X)


# --- through the model ----------------------------------------------------------------

@pytest.fixture
def interpreted(monkeypatch):
    """"pallas_here": the ragged decode row with the interpreted per-token kernel."""
    monkeypatch.setitem(DECODE_IMPLS, "pallas_here", dataclasses.replace(
        DECODE_IMPLS["pallas_tpu"], backends=("cpu",), tokens=Impl(
            f"{__name__}:tokens", ("cpu",), pallas=True)))
    return "pallas_here"


def _model(impl):
    return dataclasses.replace(tiny_cfg().model, compute_dtype="bfloat16", init_std=0.2,
                               batch_invariant=True, decode_attention_impl=impl,
                               kv_cache_layout="bksd", decode_block=X)


def test_the_cache_has_the_slots_the_kernel_copies(interpreted):
    m = _model(interpreted)
    assert tf.init_cache(m, 2, 40)["mask"].shape == (2, 64)
    assert tf.init_cache(dataclasses.replace(m, batch_invariant=False), 2, 40)[
        "mask"].shape == (2, 40)
    assert tf.init_cache(_model("blocks"), 2, 40)["mask"].shape == (2, 40)


@pytest.mark.integration
@pytest.mark.parametrize("sampler", [ro.sample, continuous.sample], ids=["static", "continuous"])
def test_the_kernel_keeps_the_sampler_bitwise(interpreted, sampler):
    """With a decode row that brings the per-token kernel, the sampler's prefill and
    decode steps and the trainer's forward all run it (left-padded prompts, refilled
    slots, the cache's end), and the sampler still records the trainer's log-probs,
    experts and gate weights bit for bit, in bfloat16 at temperature 0.7; the same model
    with `attend`'s own blocks samples otherwise."""
    m = _model(interpreted)
    sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise", temperature=0.7,
                                   max_batch=4)
    params, r = bw.sample(m, sampling, *bw.prompts(b=8, seed=5), sampler=sampler)
    bw.assert_bitwise(params, r, m, 0.7)
    _, r_own = bw.sample(_model("blocks"), sampling, *bw.prompts(b=8, seed=5),
                         sampler=sampler)
    assert not np.array_equal(np.asarray(r_own.logp_mu_BxS), np.asarray(r.logp_mu_BxS))


@pytest.mark.integration
def test_a_bitwise_run_with_the_kernel_records_zero_mismatch(tmp_path, interpreted):
    """A whole RL run (bf16 compute, R3) with the per-token kernel, packed scoring and
    update and partial rollouts (each token against π_old of the version that drew it):
    every step's logged mismatch is exactly zero and every IS weight exactly 1. (On one
    device: with arrays split over several CPU devices, the TPU interpreter's simulated
    DMAs abort the process; the kernel under the per-token layer's shard_map is
    compiled for a v5p-8 mesh by the `tpu` tier instead, tests/pod/aot_test.py.)"""
    base = tiny_cfg(steps=2, replay="r3", pack_tokens=48, pack_rows=2, max_staleness=1,
                    old_policy="behavior")
    cfg = dataclasses.replace(
        base, model=dataclasses.replace(_model(interpreted), init_std=base.model.init_std),
        sampling=dataclasses.replace(base.sampling, numerics="bitwise"))
    bw.assert_zero_mismatch_run(cfg, str(tmp_path / "run"))
