"""Zero mismatch (model/invariant.py): with batch-invariant numerics the sampler's log μ,
experts and gate weights equal the trainer's bit for bit, whatever the call shapes; and
the XLA behaviours that rests on, each tested on its own."""
import dataclasses

import bitwise_helpers as bw
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg

from stablerl_jax import sharding
from stablerl_jax.config import ConfigError, ExperimentConfig, SamplingConfig, apply_overrides
from stablerl_jax.kernels import fused_logprob, gmm_pallas
from stablerl_jax.kernels import gmm as gmm_lib
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS, LogprobBlocks, LogprobImpl
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, GmmBlocks, GmmImpl
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import invariant
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as ro

HI = jax.lax.Precision.HIGHEST


# --- what the design relies on ------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tile_body_gives_a_row_the_same_bits_wherever_it_sits(dtype):
    """`rowwise`'s reliance: inside one compiled tile body, a row's product and its
    reductions over the last axis do not depend on the other rows, on its offset in the
    tile or on how many tiles the call has (one tile: XLA may inline the loop)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((96, 64)), dtype)
    w = jnp.asarray(rng.standard_normal((64, 200)), dtype)

    def body(t):
        z = invariant.dot(t, w, dtype)
        return jax.nn.log_softmax(z, axis=-1), jnp.sum(z * z, axis=-1)

    f = jax.jit(lambda r: invariant.rowwise(body, r))
    full = jax.tree.map(np.asarray, f(x))
    for start, n in [(0, 1), (5, 1), (3, 2), (7, 7), (13, 31), (1, 33), (40, 56)]:
        part = f(x[start:start + n])
        for a, b in zip(part, full):
            assert np.array_equal(np.asarray(a), b[start:start + n]), (start, n)


def test_skipped_and_masked_key_blocks_change_nothing():
    """`attend`'s reliance: a key block past a query's position, computed with every key
    masked or skipped, leaves the online softmax's state bit for bit (max(m, −inf) = m,
    exp(0) = 1, x + 0 = x), so more slots, more left padding or a longer cache give the
    same output."""
    rng = np.random.default_rng(2)
    b, s, kv, dh, h = 2, 40, 2, 8, 4
    k = jnp.asarray(rng.standard_normal((b, s, kv, dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kv, dh)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, h, dh)), jnp.float32)
    mask = jnp.ones((b, s), bool)
    pos, row, start = jnp.array([0, 17, 33]), jnp.array([0, 1, 1]), jnp.array([0, 2, 2])
    run = lambda k_, v_, m_, st: invariant.attend(q, pos, row, st, k_, v_, m_, kv_heads=kv,
                                                  dtype=jnp.float32)
    base = np.asarray(run(k, v, mask, start))
    # 70 more slots after the sequence (a longer cache: blocks never reached) ...
    pad = lambda a: jnp.concatenate([a, jnp.asarray(rng.standard_normal(
        (b, 70) + a.shape[2:]), a.dtype)], axis=1)
    assert np.array_equal(np.asarray(run(pad(k), pad(v), jnp.pad(mask, ((0, 0), (0, 70))),
                                         start)), base)
    # ... and 45 more slots of left padding before it (garbage keys, masked).
    lead = lambda a: jnp.concatenate([jnp.asarray(rng.standard_normal(
        (b, 45) + a.shape[2:]), a.dtype), a], axis=1)
    assert np.array_equal(np.asarray(run(lead(k), lead(v), jnp.pad(mask, ((0, 0), (45, 0))),
                                         start + 45)), base)


ON_CPU = jax.default_backend() == "cpu"
# Pallas blocks that split the MoE tile (32) into two row blocks and D, F into several
# column and K blocks (16: Triton's smallest dot when the suite runs on a GPU).
PALLAS_BLOCK = GmmBlocks(rows=16, cols=16, depth=16, t_rows=16, t_cols=16, t_depth=16)


def _invariant_gmms():
    """The batch-invariant rows of GMM_IMPLS this backend runs (a Pallas row on a CPU in
    the interpreter), each as (name, callable)."""
    here = jax.default_backend()
    return [(name, row.load(block=PALLAS_BLOCK if row.pallas else None,
                            interpret=here not in row.backends))
            for name, row in GMM_IMPLS.items()
            if row.invariant and (here in row.backends or (ON_CPU and row.pallas))]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name,gmm", _invariant_gmms(), ids=lambda a: a if isinstance(
    a, str) else "")
def test_a_grouped_tile_row_ignores_the_rest_of_its_group(name, gmm, dtype):
    """`experts`' reliance, for every row of GMM_IMPLS marked batch-invariant (the
    reference `loop` and the Pallas kernels): a row's output does not depend on which
    rows share its tile, on the other groups or on how many rows the call has."""
    rng = np.random.default_rng(3)
    tile, d, f = 32, 40, 48
    w = jnp.asarray(rng.standard_normal((3, d, f)), dtype)
    row = jnp.asarray(rng.standard_normal((d,)), dtype)
    outs = []
    for seed, sizes, rows, at in [(0, (32, 64, 0), 96, 41), (1, (0, 32, 32), 96, 3),
                                  (2, (64, 32, 32), 160, 90), (3, (0, 32, 0), 32, 31)]:
        lhs = np.random.default_rng(seed).standard_normal((rows, d)).astype(np.float32)
        group = int(np.searchsorted(np.cumsum(sizes), at, side="right"))
        lhs = jnp.asarray(lhs, dtype).at[at].set(row)
        out = jax.jit(lambda a, b, g: gmm(a, b, g, tile, HI))(lhs, w, jnp.asarray(sizes,
                                                                              jnp.int32))
        outs.append((group, np.asarray(out[at], np.float32)))
    assert {g for g, _ in outs} == {1}
    assert all(np.array_equal(o, outs[0][1]) for _, o in outs), name


def test_the_per_token_ffn_runs_the_models_grouped_matmul_where_it_is_batch_invariant():
    """`invariant.grouped_matmul`: the model's gmm_impl where its row is marked
    batch-invariant, else the reference."""
    assert {n for n, r in GMM_IMPLS.items() if r.invariant} == {"loop", "pallas_gpu",
                                                               "pallas_tpu"}
    for name in ("tiles", "ragged_dot", "megablox", "loop"):
        assert invariant.grouped_matmul(name) is gmm_lib.loop, name
    for target in ("gpu", "tpu"):
        fn = invariant.grouped_matmul(f"pallas_{target}")
        assert fn.func is gmm_pallas.pallas and fn.keywords["target"] == target


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_expert_row_crosses_the_mesh_unchanged(dtype):
    """Expert parallelism's reliance (`invariant.experts` on a mesh, the layer's weight
    gathers): an all-gather of the peers' rows and an all-to-all (what the exchange's
    ragged all-to-all is built from where XLA has none: expert_parallel.ragged_all_to_all)
    return each row's bits."""
    from jax.sharding import PartitionSpec as P
    mesh = sharding.make_mesh(1, 2, 4, devices=cpu_devices())
    axes = ("fsdp", "expert")
    rng = np.random.default_rng(4)
    rows = jnp.asarray(rng.standard_normal((8, 8, 16)) * 10.0 ** rng.integers(-6, 6, (8, 8, 1)),
                       dtype)  # 8 rows per device

    def local(r):
        every = jax.lax.all_gather(r[0], axes, axis=0, tiled=True)           # [8·8, 16]
        moved = jax.lax.all_to_all(r[0], axes, 0, 0, tiled=True)             # row i to i
        return every[None], moved[None]

    every, moved = jax.shard_map(local, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                                 check_vma=False)(rows)
    bits = lambda a: np.asarray(a).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32)
    assert np.array_equal(bits(every[3]), bits(rows.reshape(-1, 16)))
    # Device j's row i went to device i, as its row j.
    assert np.array_equal(bits(moved), bits(np.swapaxes(np.asarray(rows), 0, 1)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gmm", ["loop", "pallas"])
def test_an_exchanged_expert_row_is_one_devices(dtype, gmm):
    """`invariant.experts` on 8 expert shards (ragged all-to-alls carry each assignment
    to its expert's shard and its output back): the FFN's rows equal one device's bit
    for bit, with the reference grouped matmul and with the Pallas kernel (run on each
    shard)."""
    gmm = dict(_invariant_gmms())["pallas_tpu" if ON_CPU else "pallas_gpu"] \
        if gmm == "pallas" else None
    from jax.sharding import PartitionSpec as P
    mesh = sharding.make_mesh(1, 1, 8, devices=cpu_devices())
    rng = np.random.default_rng(5)
    n, e, d, f, k = 32, 16, 16, 24, 2
    x = jnp.asarray(rng.standard_normal((n, d)), dtype)
    idx = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
    w = jnp.asarray(rng.random((n, k)), dtype)
    ws = [jnp.asarray(rng.standard_normal(shape) * 0.3, dtype)
          for shape in ((e, d, f), (e, d, f), (e, f, d))]
    one = invariant.experts(x, idx, w, *ws, tile=4, gmm=gmm)
    bits = lambda a: np.asarray(a).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32)
    local = lambda *a: invariant.experts(*a, tile=4, ep_axes=("expert",), gmm=gmm)
    many = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("expert"),
                                 out_specs=P("expert"), check_vma=False))(x, idx, w, *ws)
    assert np.array_equal(bits(many), bits(one))


# --- the sampler against the trainer ------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("dtype,temperature", [("float32", 1.0), ("bfloat16", 0.7)])
def test_the_static_sampler_scores_as_the_trainer(dtype, temperature):
    m = bw.model(dtype)
    sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise",
                                   temperature=temperature)
    prompts, pmask = bw.prompts()
    params, r = bw.sample(m, sampling, prompts, pmask)
    lp = bw.assert_bitwise(params, r, m, temperature)
    # R3: the replayed routes are the live ones, and the scores do not move.
    assert np.array_equal(bw.assert_bitwise(params, r, m, temperature, replay=True), lp)
    # Another batch (a sub-batch, micro-batches) or a trimmed window: the same bits.
    attn = r.prompt_mask_BxS | r.completion_mask_BxS
    lo = int(np.argmax(np.asarray(attn).any(0)))
    assert lo > 0
    sub, _, _ = policy_logprobs(params, r.tokens_BxS[:2, lo:], attn[:2, lo:], m,
                                temperature=temperature)
    assert np.array_equal(np.asarray(sub), lp[:2, lo:])


@pytest.mark.integration
@pytest.mark.parametrize("kw", [{"kv_cache_layout": "bksd"}, {"unroll_layers": True},
                                {"remat": "full", "moe_tile": 4}, {"row_tile": 8},
                                {"row_tile": 128}])
def test_cache_layouts_layer_loops_and_row_tiles_keep_it_bitwise(kw):
    m = bw.model("bfloat16", **kw)
    sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise")
    params, r = bw.sample(m, sampling, *bw.prompts(seed=1))
    bw.assert_bitwise(params, r, m, 1.0)


@pytest.mark.integration
def test_the_continuous_sampler_scores_as_the_trainer():
    """Slots refilled as responses finish, one cache index per row: still the trainer's
    bits."""
    m = bw.model("bfloat16")
    sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise", continuous=True,
                                   max_batch=4)
    params, r = bw.sample(m, sampling, *bw.prompts(b=8, seed=2), sampler=continuous.sample)
    bw.assert_bitwise(params, r, m, 1.0)


KERNEL_CALLS = []


def pallas_gmm(*args, interpret=False, **kw):
    """The Pallas grouped matmul as a row of GMM_IMPLS registered for the test below: the
    TPU lowering, interpreted on a CPU; the rows it is traced for are counted."""
    del interpret
    KERNEL_CALLS.append(args[0].shape[0])
    target = "gpu" if jax.default_backend() == "gpu" else "tpu"
    return gmm_pallas.pallas(*args, target=target, interpret=ON_CPU, **kw)


@pytest.mark.integration
def test_a_pallas_grouped_matmul_keeps_it_bitwise(monkeypatch):
    """With the Pallas grouped matmul as gmm_impl (a batch-invariant row), the sampler's
    prefill and decode steps and the trainer's forward run it, and the sampler still
    scores as the trainer, bit for bit, in bfloat16."""
    monkeypatch.setitem(GMM_IMPLS, "pallas_here", GmmImpl(
        f"{__name__}:pallas_gmm", ("cpu", "gpu"), blocks=PALLAS_BLOCK, pallas=True,
        invariant=True))
    KERNEL_CALLS.clear()
    m = bw.model("bfloat16", gmm_impl="pallas_here", moe_tile=16)
    sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise")
    params, r = bw.sample(m, sampling, *bw.prompts(seed=3))
    sampled = len(KERNEL_CALLS)
    assert sampled >= 6  # 3 per layer, prefill and decode step traced
    bw.assert_bitwise(params, r, m, 1.0)
    assert len(KERNEL_CALLS) > sampled


def pallas_logprob(hidden, unembed, targets, interpret=False, **kw):
    """The Pallas fused log-prob as a row of LOGPROB_IMPLS registered for the test below
    (the TPU lowering interpreted on a CPU); each trace is counted, by form: "dist" (the
    sampler's whole distribution) or "fused" (the trainer's op)."""
    del interpret
    KERNEL_CALLS.append("dist" if targets is None else "fused")
    target = "gpu" if jax.default_backend() == "gpu" else "tpu"
    return fused_logprob.pallas(hidden, unembed, targets, target=target, interpret=ON_CPU,
                                **kw)


def _register_pallas_logprob(monkeypatch):
    """`pallas_logprob` as the batch-invariant row "pallas_here": blocks of 16 tokens,
    2 vocabulary splits of 2 tiles of 16, a D loop of 2 slices; its traces counted anew."""
    monkeypatch.setitem(LOGPROB_IMPLS, "pallas_here", LogprobImpl(
        f"{__name__}:pallas_logprob", ("cpu", "gpu"), blocks=LogprobBlocks(
            tokens=16, vocab=16, vocab_tiles=2, dim=16, bwd_chunk=32, bwd_tokens=16,
            bwd_vocab=16), pallas=True, invariant=True))
    KERNEL_CALLS.clear()


@pytest.mark.integration
@pytest.mark.parametrize("sampler", [ro.sample, continuous.sample], ids=["static", "continuous"])
def test_a_pallas_fused_logprob_keeps_it_bitwise(monkeypatch, sampler):
    """With the Pallas fused log-prob as rl.logprob_impl (a batch-invariant row), the
    sampler draws every token from the kernel's whole distribution and the trainer scores
    with the fused kernel (its own gradient, no per-row tiles), and the two agree bit for
    bit in bfloat16 at temperature 0.7; blocks of 16 tokens, 2 vocabulary splits of 2
    tiles of 16 and a D loop of 2 slices."""
    _register_pallas_logprob(monkeypatch)
    m = bw.model("bfloat16")
    sampling = dataclasses.replace(tiny_cfg().sampling, numerics="bitwise", temperature=0.7)
    prompts, pmask = bw.prompts(b=8, seed=4)
    params = tf.init_params(jax.random.key(0), m)
    r = sampler(params, prompts, pmask, jax.random.key(1), m, sampling,
                nx.of_sampling(sampling, 0), eos_id=EOS_ID, pad_id=PAD_ID,
                logprob_impl="pallas_here")
    assert set(KERNEL_CALLS) == {"dist"}
    bw.assert_bitwise(params, r, m, 0.7, impl="pallas_here")
    assert KERNEL_CALLS.count("fused") == 1
    # The default row samples otherwise (the kernel's tiles are not the row tiles').
    r_tiles = sampler(params, prompts, pmask, jax.random.key(1), m, sampling,
                      nx.of_sampling(sampling, 0), eos_id=EOS_ID, pad_id=PAD_ID)
    assert not np.array_equal(np.asarray(r_tiles.logp_mu_BxS), np.asarray(r.logp_mu_BxS))


def test_values_come_from_the_tiles_and_the_gradient_from_the_reference_at_their_routes():
    """with_reference_gradient: the forward's bits are fn's; the backward is the
    reference's VJP at what fn kept (its route), not at a route of its own. The reference
    here differs on purpose (3x, not 2x) so that each part shows where it came from."""
    x = jnp.array([0.3, 2.0, -1.0, 1.5])
    tiled = lambda x: (2.0 * x[jnp.argmax(x)], jnp.argmax(x))
    reference = lambda route, x: (3.0 * x[route], route)
    f = invariant.with_reference_gradient(tiled, reference, keep=lambda out: out[1])
    value, route = jax.jit(f)(x)
    assert float(value) == 4.0 and int(route) == 1
    grad = jax.jit(jax.grad(lambda x: f(x)[0]))(x)
    assert np.array_equal(np.asarray(grad), np.array([0.0, 3.0, 0.0, 0.0], np.float32))


@pytest.mark.integration
def test_the_update_differentiates_through_the_tiles():
    """The trainer's gradient under per-token numerics (the untiled layers' backward at
    the tiles' routes and activations): finite and equal to the gradient of the same
    loss without tiles up to float32 rounding."""
    m = bw.model("float32")
    params = tf.init_params(jax.random.key(0), m)
    tokens = jax.random.randint(jax.random.key(2), (3, 12), 4, 64)
    attn = jnp.ones((3, 12), bool).at[0, :4].set(False)
    scored = attn[:, :-1] & attn[:, 1:]  # (a padding slot's output is not the same function)
    loss = lambda p, mc: jnp.sum(policy_logprobs(p, tokens, attn, mc)[0] * scored)
    g_inv = jax.grad(loss)(params, m)
    g_ref = jax.grad(loss)(params, dataclasses.replace(m, batch_invariant=False))
    # Reassociated float32 sums of at most n = 64 terms per entry (36 scored tokens, 2
    # layers, top-2): |error| <= n · eps · Σ|terms|, bounded here by the leaf's scale.
    bound = 64 * np.finfo(np.float32).eps
    for a, b in zip(jax.tree.leaves(g_inv), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.all(np.isfinite(a)) and np.abs(a - b).max() <= bound * np.abs(b).max()


def _mesh_engine(mesh, layout="train", expert_parallel=True, continuous=False):
    cfg = tiny_cfg(mesh=mesh, num_minibatches=1)
    return Engine.create(cfg.replace(
        model=cfg.model.replace(compute_dtype="bfloat16", expert_parallel=expert_parallel,
                                init_std=0.2, batch_invariant=True),
        sampling=SamplingConfig(max_new_tokens=12, numerics="bitwise", layout=layout,
                                continuous=continuous, max_batch=8 if continuous else 0)),
        eos_id=EOS_ID, pad_id=PAD_ID, devices=cpu_devices(int(np.prod(mesh))))


@pytest.mark.integration
@pytest.mark.parametrize("mesh,layout,expert_parallel,continuous", [
    ((2, 2, 2), "train", True, False), ((8, 1, 1), "train", False, False),
    ((1, 1, 8), "serve", True, True), ((2, 2, 2), "train", False, True)])
def test_on_a_mesh_the_sampler_scores_as_the_trainer(mesh, layout, expert_parallel,
                                                     continuous):
    """8 CPU devices, bfloat16: each device runs the tiles on its own rows (experts
    exchanged over the expert axes, or their weights gathered), so the score step's
    log π_old equals the sampler's log μ bit for bit, in the training layout and in the
    serving one (whose weights are split otherwise), and both equal one device's bits."""
    eng = _mesh_engine(mesh, layout, expert_parallel, continuous)
    params = tf.init_params(jax.random.key(0), eng.cfg.model)
    prompts, pmask = bw.prompts(b=8, p=8, seed=3)
    r = eng.sample(params, prompts, pmask, jax.random.key(2))
    batch, _ = eng.score(params, r, jnp.linspace(0.0, 1.0, 8))
    scored = np.asarray(batch.mask_BxT) > 0
    mu = np.asarray(batch.rollout_logp_BxT)[scored]
    assert scored.sum() > 40 and np.array_equal(mu, np.asarray(batch.old_logp_BxT)[scored])
    attn = r.prompt_mask_BxS | r.completion_mask_BxS
    one, _, aux = jax.jit(lambda p: policy_logprobs(p, r.tokens_BxS, attn, eng.cfg.model))(
        params)
    drawn = np.asarray(r.completion_mask_BxS[:, 1:])
    assert np.array_equal(np.asarray(one)[drawn], np.asarray(r.logp_mu_BxS[:, 1:])[drawn])
    rec = np.asarray(r.routes_mu_BxSxLxK[:, :-1, :, 0]) >= 0
    assert np.array_equal(np.asarray(r.routes_mu_BxSxLxK[:, :-1])[rec],
                          np.asarray(aux["routes"])[rec])


@pytest.mark.integration
def test_on_a_mesh_the_gradient_is_one_devices_up_to_rounding():
    """The update's gradient through the per-device tiles (shard_map sums a gathered
    weight's cotangent over the devices): one device's within float32 reassociation."""
    m = bw.model("float32", expert_parallel=True)
    params = tf.init_params(jax.random.key(0), m)
    tokens = jax.random.randint(jax.random.key(2), (8, 12), 4, 64)
    attn = jnp.ones((8, 12), bool).at[0, :4].set(False)
    scored = attn[:, :-1] & attn[:, 1:]
    loss = lambda p, mesh: jnp.sum(policy_logprobs(p, tokens, attn, m, mesh=mesh)[0] * scored)
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    placed = jax.device_put(params, sharding.tree_shardings(tf.param_logical_axes(m), params,
                                                            mesh))
    g_one = jax.jit(jax.grad(lambda p: loss(p, None)))(params)
    g_mesh = jax.jit(jax.grad(lambda p: loss(p, mesh)))(placed)
    # Per-device partial sums reassociate the one-device sum over 80 scored tokens (at
    # most 2·80 terms per entry with top-2): |error| <= 160 · eps · max|g|.
    bound = 160 * np.finfo(np.float32).eps
    for a, b in zip(jax.tree.leaves(g_one), jax.tree.leaves(g_mesh)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= bound * np.abs(a).max()


# --- configuration ------------------------------------------------------------------

def test_bitwise_turns_on_batch_invariance_and_refuses_what_it_cannot_hold():
    cfg = apply_overrides(ExperimentConfig(), ["sampling.numerics=bitwise"])
    assert cfg.model.batch_invariant
    for bad, field in [(["sampling.numerics=bitwise", "sampling.top_k=5"], "numerics"),
                       (["sampling.numerics=bitwise", "sampling.top_p=0.9"], "numerics")]:
        with pytest.raises(ConfigError, match=field) as e:
            apply_overrides(ExperimentConfig(), bad)
        assert "\n" not in str(e.value)


@pytest.mark.integration
@pytest.mark.parametrize("rl", [{}, {"pack_tokens": 48, "pack_rows": 2},
                                {"num_minibatches": 1, "score_in_update": True},
                                {"max_staleness": 1, "old_policy": "behavior"},
                                {"microbatches": 2}, {"mesh": (2, 1, 2)},
                                {"logprob_impl": "pallas_here", "max_staleness": 1,
                                 "old_policy": "behavior", "mesh": (2, 1, 2)}],
                         ids=["padded", "packed", "score_in_update", "partial_rollouts",
                              "microbatches", "mesh", "pallas_logprob_partial_mesh"])
def test_a_bitwise_run_records_zero_mismatch(tmp_path, monkeypatch, rl):
    """A whole RL run (bf16 compute, R3; two mini-batches, packed scoring and update, the
    score pass inside the update, micro-batches, 4 devices, or the Pallas fused log-prob
    under partial rollouts on 4 devices): every step's logged mismatch is exactly zero
    and every IS weight exactly 1. Under partial rollouts each token against π_old of
    the version that drew it."""
    _register_pallas_logprob(monkeypatch)
    base = tiny_cfg(steps=2, replay="r3", **rl)
    cfg = dataclasses.replace(
        base, model=dataclasses.replace(base.model, compute_dtype="bfloat16",
                                        batch_invariant=True),
        sampling=dataclasses.replace(base.sampling, numerics="bitwise"))
    bw.assert_zero_mismatch_run(cfg, str(tmp_path / "run"))
    if rl.get("logprob_impl"):
        assert {"dist", "fused"} <= set(KERNEL_CALLS)


@pytest.mark.integration
def test_the_check_command_passes_bitwise_and_names_where_exact_parts(capsys):
    from experiments import bitwise_check
    assert bitwise_check.main(["--rows", "4", "--new-tokens", "6",
                               "model.compute_dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "OK: the sampler computes the trainer's numbers bit for bit" in out
    assert "layer 1 expert FFN: equal" in out
    assert bitwise_check.main(["--rows", "4", "--new-tokens", "6", "sampling.numerics=exact",
                               "model.compute_dtype=bfloat16"]) == 1
    out = capsys.readouterr().out
    assert "first to part: layer" in out and "ulps" in out and "DIFFERENT" in out
    assert bitwise_check.main(["--rows", "0"]) == 2
    assert "--rows: must be in [1, 4,096], got 0" in capsys.readouterr().err


@pytest.mark.integration
def test_the_check_command_on_a_mesh_in_the_serving_layout(capsys):
    """8 CPU devices, experts spread over all of them in the sampler's decode loop."""
    from experiments import bitwise_check
    args = ["--new-tokens", "6", "model.compute_dtype=bfloat16", "mesh=1,2,4",
            "sampling.layout=serve"]
    assert bitwise_check.main(args) == 0
    out = capsys.readouterr().out
    assert "mesh (1, 2, 4), sampler layout serve" in out and "OK:" in out
    assert bitwise_check.main(["--rows", "6", *args]) == 2
    assert "--rows=6 must be a multiple of the mesh's 8 devices" in capsys.readouterr().err


def test_ulps_counts_units_in_the_last_place():
    from experiments.bitwise_check import ulps
    one = np.float32(1.0)
    up = np.nextafter(np.nextafter(one, np.float32(2)), np.float32(2))
    f32 = lambda *x: np.array(x, np.float32)
    assert ulps(f32(one, -0.0, one), f32(up, 0.0, one)).tolist() == [2, 0, 0]
    assert ulps(np.array([np.float32(-1e-45)]), np.array([np.float32(1e-45)]))[0] == 2


@pytest.mark.integration
def test_the_check_passes_on_a_hugging_face_qwen3_moe_checkpoint(tmp_path, capsys):
    """A Qwen3-MoE checkpoint's own architecture (q/k norms, GQA, untied head, its dtype)
    through --hf: bitwise in its bfloat16."""
    from hf_fixtures import write_qwen3_moe, write_qwen_tokenizer

    from experiments import bitwise_check
    ckpt = tmp_path / "qwen"
    ckpt.mkdir()
    write_qwen3_moe(ckpt, write_qwen_tokenizer(ckpt))
    write_qwen_tokenizer(ckpt)
    assert bitwise_check.main(["--hf", str(ckpt), "--rows", "4", "--new-tokens", "6",
                               "model.compute_dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "sampler numerics 'bitwise' (per-token)" in out and "compute bfloat16" in out
    assert "OK: the sampler computes the trainer's numbers bit for bit" in out



def test_the_bitwise_preset_without_a_per_token_model_is_an_error():
    model = dataclasses.replace(tiny_cfg().model, batch_invariant=False)
    with pytest.raises(ValueError, match="ModelConfig.batch_invariant=True"):
        tf.forward(tf.init_params(jax.random.key(0), model), jnp.ones((1, 4), jnp.int32),
                   model, numerics=nx.numerics_preset("bitwise"))
