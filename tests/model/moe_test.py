"""Routing with replay, and the two dispatch paths, on hand-worked and random inputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax.model import moe
from tolerance import assert_close

# probs [.1 .2 .3 .4] and [.5 .125 .125 .25]: top-2 and its renormalized weights by hand.
LOGITS = jnp.log(jnp.array([[1.0, 2.0, 3.0, 4.0], [4.0, 1.0, 1.0, 2.0]]))
# float32 roundings of a softmax probability: the logits' log (1 each, relative to
# |log 4| < 1.4, which exp turns into a relative error: 3 for the two logits in z − max),
# − max 1, exp 1, Σ over E = 4: 3, ÷ 1. The top-k weights renormalize: Σ over K = 2, ÷.
N_PROB = 3 + 1 + 1 + 3 + 1
N_WEIGHT = N_PROB + 2


def test_route_top_k_by_hand():
    idx, w, probs = moe.route(LOGITS, 2)
    np.testing.assert_array_equal(idx, [[3, 2], [0, 3]])
    assert_close(w, [[4 / 7, 3 / 7], [2 / 3, 1 / 3]], n=N_WEIGHT)
    assert_close(probs[1], [0.5, 0.125, 0.125, 0.25], n=N_PROB)
    assert idx.dtype == jnp.int32


def test_route_replay_by_hand_with_minus_one_rows():
    replay = jnp.array([[0, 1], [-1, -1]], jnp.int32)
    idx, w, _ = moe.route(LOGITS, 2, replay)
    np.testing.assert_array_equal(idx, [[0, 1], [0, 3]])  # token 1 routed normally
    assert_close(w, [[1 / 3, 2 / 3], [2 / 3, 1 / 3]], n=N_WEIGHT)


def test_router_gradient_reaches_replayed_expert_outside_top_k():
    # Experts 0 and 1 are not in token 0's top-2; replaying them, w_1 = σ(l1 − l0),
    # so ∂w_1/∂l1 = w_1 (1 − w_1) = 2/9 and ∂w_1/∂l0 = −2/9, others 0.
    replay = jnp.array([[0, 1], [-1, -1]], jnp.int32)
    g = jax.grad(lambda l: moe.route(l, 2, replay)[1][0, 1])(LOGITS)
    # Norm-wise: the zeros are cancellations. The forward's roundings, the same path
    # transposed, and the softmax VJP's Σ over E = 4.
    assert_close(g[0], [-2 / 9, 2 / 9, 0.0, 0.0], n=2 * N_WEIGHT + 3, scale="max")
    assert float(jnp.abs(g[1]).max()) == 0.0


def test_norm_topk_prob_off_combines_with_the_raw_probabilities():
    idx, w, probs = moe.route(LOGITS, 2, normalize=False)
    np.testing.assert_array_equal(idx, [[3, 2], [0, 3]])
    assert_close(w, [[0.4, 0.3], [0.5, 0.25]], n=N_PROB)


def test_weight_replay_uses_the_recorded_weights_and_stops_their_gradient():
    replay = jnp.array([[0, 1], [-1, -1]], jnp.int32)
    recorded = jnp.array([[0.9, 0.1], [0.0, 0.0]], jnp.float32)
    idx, w, _ = moe.route(LOGITS, 2, replay, recorded)
    np.testing.assert_array_equal(idx, [[0, 1], [0, 3]])
    # Token 0 combines with the recorded weights exactly; token 1 (row of -1) routes live.
    np.testing.assert_array_equal(w[0], recorded[0])
    assert_close(w[1], [2 / 3, 1 / 3], n=N_WEIGHT)
    # The router gets no gradient through a recorded token's combine weights.
    g = jax.grad(lambda l: jnp.sum(moe.route(l, 2, replay, recorded)[1][0]
                                   * jnp.array([1.0, -2.0])))(LOGITS)
    assert float(jnp.abs(g).max()) == 0.0
    for bad, match in [((None, recorded), "need the recorded routes"),
                       ((replay, recorded[:, :1]), "replay_weights: shape"),
                       ((replay, replay), "float type")]:
        with pytest.raises(ValueError, match=match):
            moe.route(LOGITS, 2, *bad)


@pytest.mark.parametrize("replay,match", [
    (jnp.zeros((2, 3), jnp.int32), "shape"),
    (jnp.zeros((2, 2), jnp.float32), "dtype"),
    (jnp.array([[0, 4], [1, 2]], jnp.int32), "values must be in"),
    (jnp.array([[0, -2], [1, 2]], jnp.int32), "values must be in"),
    (jnp.array([[0, -1], [1, 2]], jnp.int32), "mix both"),
    (jnp.array([[1, 1], [1, 2]], jnp.int32), "repeat an expert"),
])
def test_invalid_replay_is_a_clear_error(replay, match):
    with pytest.raises(ValueError, match=match):
        moe.route(LOGITS, 2, replay)


def test_invalid_replay_under_jit_poisons_weights():
    # Values cannot be checked while tracing; a bad row must not pass silently.
    bad = jnp.array([[0, 7], [-1, -1]], jnp.int32)
    _, w, _ = jax.jit(lambda r: moe.route(LOGITS, 2, r))(bad)
    assert np.isnan(w[0]).all() and np.isfinite(w[1]).all()


def test_route_k_error():
    with pytest.raises(ValueError, match="k=5"):
        moe.route(LOGITS, 5)


def _random_moe(t=37, d=16, f=24, e=8, k=2, seed=0):
    """float64 (under the `x64` fixture): the dispatch tests compare two algorithms."""
    ks = jax.random.split(jax.random.key(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float64)
    x = normal(ks[0], (t, d))
    ws = (normal(ks[1], (e, d, f)) * 0.3, normal(ks[2], (e, d, f)) * 0.3,
          normal(ks[3], (e, f, d)) * 0.3)
    logits = normal(ks[4], (t, e))
    return x, ws, logits, k


# Roundings of one expert output y_t: gate/up dot over D = 16, SwiGLU and the combine
# weight (~5), the down projection (the dense path sums over E·F = 8·24 at once), the
# combine over K = 2.
N_FFN = 16 + 5 + 8 * 24 + 2


@pytest.mark.parametrize("tile", [pytest.param(1, marks=pytest.mark.slow), 8, 64])
def test_dense_and_grouped_agree_in_value_and_gradient(x64, tile):
    x, ws, logits, k = _random_moe()
    cot = jax.random.normal(jax.random.key(9), x.shape, jnp.float64)

    def loss(path, x, ws, logits):
        idx, w, _ = moe.route(logits, k)
        if path == "dense":
            y = moe.experts_dense(x, idx, w, *ws)
        else:
            y = moe.experts_grouped(x, idx, w, *ws, tile=tile)
        return jnp.sum(y * cot)

    vd, gd = jax.value_and_grad(lambda *a: loss("dense", *a), argnums=(0, 1, 2))(x, ws, logits)
    vg, gg = jax.jit(jax.value_and_grad(lambda *a: loss("grouped", *a), argnums=(0, 1, 2)))(
        x, ws, logits)
    # The value: y then Σ y·cot over T·D = 37·16 terms, whose cancellation is its cond.
    y = moe.experts_dense(x, *moe.route(logits, k)[:2], *ws)
    terms = np.asarray(y * cot)
    assert_close(vg, vd, n=N_FFN + 37 * 16 + 1, dtype="float64",
                 cond=np.abs(terms).sum() / abs(terms.sum()))
    # Gradients, norm-wise: the forward path, the same path transposed, and the Σ over the
    # T·K = 74 routed pairs every weight gradient reduces over.
    for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gd)):
        assert_close(a, b, n=2 * N_FFN + 37 * 2, dtype="float64", scale="max")


def test_grouped_is_dropless_when_all_tokens_pick_one_expert(x64):
    # Every token routes to experts {0, 1}: a capacity-limited dispatch would drop most.
    x, ws, _, k = _random_moe(t=50)
    idx = jnp.tile(jnp.array([[0, 1]], jnp.int32), (50, 1))
    w = jnp.full((50, 2), 0.5, jnp.float64)
    # Norm-wise: entries of y are sums over F that cancel.
    assert_close(moe.experts_grouped(x, idx, w, *ws, tile=8),
                 moe.experts_dense(x, idx, w, *ws), n=N_FFN, dtype="float64", scale="max")


def test_plan_counts_and_sorts_to_the_same_rows(monkeypatch):
    # Both ways of placing assignments (a one-hot cumsum for small A·E, a stable sort
    # otherwise) give each assignment the same buffer row: groups in expert order, each
    # padded to the tile, assignments in their order within a group; every row distinct.
    ids = jax.random.randint(jax.random.key(3), (300,), 0, 6)
    ids = ids.at[:40].set(6)  # another device's experts (id ≥ E): not counted
    counted = moe._plan(ids, 6, 8)
    monkeypatch.setattr(moe, "_COUNTING_PLAN_MAX", 0)
    sorted_ = moe._plan(ids, 6, 8)
    mine = np.asarray(ids) < 6
    np.testing.assert_array_equal(counted[1], sorted_[1])
    np.testing.assert_array_equal(np.asarray(counted[0])[mine], np.asarray(sorted_[0])[mine])
    ids_np, rows = np.asarray(ids)[mine], np.asarray(counted[0])[mine]
    sizes = np.bincount(ids_np, minlength=6)
    np.testing.assert_array_equal(counted[1], -(-sizes // 8) * 8)
    starts = np.cumsum(counted[1]) - counted[1]
    want = np.concatenate([starts[e] + np.arange(n) for e, n in enumerate(sizes)])
    np.testing.assert_array_equal(np.sort(rows), np.sort(want))
    for e in range(6):
        np.testing.assert_array_equal(rows[ids_np == e], starts[e] + np.arange(sizes[e]))


def test_padded_rows_bound():
    assert moe.padded_rows(10, 4, 8) == 40  # 10 + 4·7 = 38 → 40
    assert moe.padded_rows(16, 2, 1) == 16


def test_router_stats_by_hand():
    # 4 tokens (last masked), K=1, E=2: tokens 0,1 → expert 0, token 2 → expert 1.
    idx = jnp.array([[0], [0], [1], [1]])
    logits = jnp.zeros((4, 2))
    probs = jax.nn.softmax(logits)
    load, z, balance = moe.router_stats(probs, idx, logits, jnp.array([1, 1, 1, 0]))
    # Counts, masks and probs (0.5) are exact. load: n·K, ÷ (2). balance: load (2),
    # × importance, Σ over E = 2, × E (3). z: log 2 (1), squared (2), Σ over T = 4 (3), ÷ n.
    assert_close(load, [2 / 3, 1 / 3], n=2)
    assert_close(balance, 2 * (2 / 3 * 0.5 + 1 / 3 * 0.5), n=5)
    assert_close(z, np.log(2.0) ** 2, n=7)


@pytest.mark.parametrize("local", [1, 2, 3])
def test_dense_local_experts_equal_the_grouped_shard(x64, local):
    """An expert-parallel shard of `local` ≤ K experts (moe.experts_local_dense, the
    serving layout's decode step) against the grouped dispatch of the same shard, every
    offset of 6 experts. With one local expert a token has at most one local term, so
    the two agree exactly; with more, their per-token sums run in another order."""
    t, d, f, num_experts, k = 24, 16, 12, 6, 3
    keys = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(keys[0], (t, d), jnp.float64)
    idx, w, _ = moe.route(jax.random.normal(keys[1], (t, num_experts), jnp.float64), k)
    wg, wu = (jax.random.normal(kk, (num_experts, d, f), jnp.float64) / d ** 0.5
              for kk in keys[2:4])
    wd = jax.random.normal(keys[4], (num_experts, f, d), jnp.float64) / f ** 0.5
    for off in range(0, num_experts, local):
        part = lambda a: a[off:off + local]
        got = moe.experts_local_dense(x, idx, w, part(wg), part(wu), part(wd),
                                      expert_offset=off)
        want = moe.experts_grouped(x, idx, w, part(wg), part(wu), part(wd), tile=4,
                                   expert_offset=off)
        assert float(jnp.abs(want).max()) > 0  # some token chose these experts
        if local == 1:
            np.testing.assert_array_equal(got, want, err_msg=f"offset {off}")
        else:  # dots over D and F, a swiglu, the sum over the local terms
            assert_close(got, want, n=d + f + local + 8, dtype="float64", scale="max",
                         err_msg=f"offset {off}")
    # The shards' outputs add up to the whole layer.
    total = sum(moe.experts_local_dense(x, idx, w, wg[o:o + local], wu[o:o + local],
                                        wd[o:o + local], expert_offset=o)
                for o in range(0, num_experts, local))
    assert_close(total, moe.experts_dense(x, idx, w, wg, wu, wd), n=d + f + k + 8,
                 dtype="float64", scale="max")
