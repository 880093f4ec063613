"""Continuous batching: the sampler that refills a finished row's slot with the next response.

Letters: I responses (the queue, in row order), n slots (rows decoded at once:
sampling.max_batch, or I), P prompt slots, C completion slots (max_new_tokens), S = P + C, V
vocab, L layers, K top-k.

The static sampler (rollout.py) runs a slice until its longest row stops, stopped rows idling.
Here, before each decode step, the lowest slot whose response is done (stop or C tokens) takes
the next pending response, prefilled alone into its cache row ([1, P]); the first n start
together ([n, P]); it ends when all I are complete (the schedule
`stablerl_jax.pod.sampler_schedules` simulates). Rows keep the static layout at different slots:
a write index per row (`tf.forward` with a [n] `cache["index"]`), decode attention reading up to
the largest row's slot.

Exactness: response r draws completion token i from fold_in(key_r, i) with its static-sampler key
(`rollout.row_keys`) and is computed alone, so its tokens, log μ, routes and weights are the
static sampler's (same row order, fewer steps) as far as matmul kernels round a row alike
whatever the batch. On CPU the FP8 and bf16 engines agree bit for bit with prefills of up to 32
rows (tests/sampling/continuous_test.py; docs/records/benchmarks.md, "Samplers side by side"); a
refill's [1, P] prefill can round unlike a [64, P] one, and the response may then draw another
token (another sample of the same distribution, with its own log μ). In float32, differently
fused programs differ in a log-prob's last bits even at small sizes; tokens and routes agree.
Field alignment: rollout.py's module docstring.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.model import invariant_layer
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import rollout as rollout_lib


class Queue(NamedTuple):
    """A continuous sampler's responses, leaves [I, ...] in queue order (a group's G adjacent;
    slots as in a Rollout). `version_IxS`: each completion token's parameter version (-1
    elsewhere); `progress_I`: tokens so far; `finished_I`: stop or C tokens; `stopped_I`: on a
    stop id. Partial rollouts carry unfinished ones on (rl/inflight.py)."""

    tokens_IxS: jax.Array            # int32: prompt in [0, P), completion from P
    prompt_mask_IxS: jax.Array       # bool
    keys_Ix2: jax.Array              # uint32: each response's key data (rollout.row_keys)
    completion_IxS: jax.Array        # bool
    logp_IxS: jax.Array              # float32, log μ of the version that drew the token
    routes_IxSxLxK: jax.Array        # int32
    route_weights_IxSxLxK: jax.Array  # float32
    version_IxS: jax.Array           # int32
    progress_I: jax.Array            # int32
    finished_I: jax.Array            # bool
    stopped_I: jax.Array             # bool


def slots_of(sampling: SamplingConfig, rows: int) -> int:
    """n: the rows decoded at once (sampling.max_batch; 0 = every row)."""
    return min(sampling.max_batch or rows, rows)


def new_queue(prompts_IxP, pmask_IxP, key, cfg: ModelConfig, sampling: SamplingConfig,
              pad_id: int) -> Queue:
    """Unstarted responses, one per prompt row; `key`: one key (split into I) or [I] keys."""
    n, p = prompts_IxP.shape
    s = p + sampling.max_new_tokens
    routes_shape = (n, s, cfg.num_layers, cfg.top_k)
    return Queue(
        tokens_IxS=jnp.full((n, s), pad_id, jnp.int32).at[:, :p].set(prompts_IxP),
        prompt_mask_IxS=jnp.zeros((n, s), bool).at[:, :p].set(pmask_IxP),
        keys_Ix2=jax.random.key_data(rollout_lib.row_keys(key, n)),
        completion_IxS=jnp.zeros((n, s), bool), logp_IxS=jnp.zeros((n, s), jnp.float32),
        routes_IxSxLxK=jnp.full(routes_shape, -1, jnp.int32),
        route_weights_IxSxLxK=jnp.zeros(routes_shape, jnp.float32),
        version_IxS=jnp.full((n, s), -1, jnp.int32), progress_I=jnp.zeros((n,), jnp.int32),
        finished_I=jnp.zeros((n,), bool), stopped_I=jnp.zeros((n,), bool))


def to_rollout(q: Queue) -> rollout_lib.Rollout:
    """The Rollout of a queue's (complete) responses."""
    return rollout_lib.Rollout(
        tokens_BxS=q.tokens_IxS, prompt_mask_BxS=q.prompt_mask_IxS,
        completion_mask_BxS=q.completion_IxS,
        lengths_B=jnp.sum(q.completion_IxS, axis=1, dtype=jnp.int32),
        logp_mu_BxS=q.logp_IxS, routes_mu_BxSxLxK=q.routes_IxSxLxK,
        route_weights_mu_BxSxLxK=q.route_weights_IxSxLxK, truncated_B=~q.stopped_I)


def sample(params, prompt_tokens_BxP, prompt_mask_BxP, key, cfg: ModelConfig,
           sampling: SamplingConfig, numerics: nx.Numerics, *, eos_id: int, pad_id: int,
           stop_ids=(), mesh=None, with_steps: bool = False, logprob_impl: str = "chunked"):
    """`rollout.sample`'s Rollout (same arguments, rows, values) by continuous batching over
    `slots_of(sampling, B)` slots; `with_steps`: (Rollout, decode steps run)."""
    rollout_lib.validate_inputs(prompt_tokens_BxP, prompt_mask_BxP, cfg, sampling, eos_id,
                                pad_id, tuple(stop_ids))
    queue = new_queue(prompt_tokens_BxP.astype(jnp.int32), prompt_mask_BxP.astype(bool), key,
                      cfg, sampling, int(pad_id))
    queue, steps = run(params, queue, 0, cfg=cfg, sampling=sampling, numerics=numerics,
                       stops=rollout_lib.stop_set(eos_id, stop_ids), pad_id=int(pad_id),
                       mesh=mesh, logprob_impl=logprob_impl)
    out = to_rollout(queue)
    return (out, steps) if with_steps else out


class _Call(NamedTuple):
    """What every piece of one `run` call reads, fixed for the call."""

    cfg: ModelConfig
    sampling: SamplingConfig
    numerics: nx.Numerics
    mesh: object
    logprob_impl: str
    pad_id: int
    prepared: dict      # the weights for the prefill (numerics.prepare_params)
    d_params: dict      # ... and for the decode loop (the serving layout's, or `prepared`)
    d_rules: object     # the decode loop's sharding rules (None: the default)
    keys_I: jax.Array   # each response's sampling key
    stops_Z: jax.Array  # Z stop ids (may be 0)
    version: jax.Array  # the weights' version, written for every token drawn
    n: int              # slots
    num_i: int          # responses in the queue
    s: int              # S = P + C
    p: int
    c: int
    one_prefill: bool   # a fresh queue with a slot per response: one static prefill
    dtype: object


class _Slots(NamedTuple):
    """The decode loop's carry."""

    q: Queue
    cache: dict
    # The hidden state each slot's next token is drawn from. Logits are computed for all
    # n slots at once, as the static sampler does for its n rows: a [1, D] row alone
    # would run another matmul kernel (another summation order).
    hidden: jax.Array
    resp: jax.Array     # [n] the response each slot holds
    done: jax.Array     # [n] no running response: the slot is free
    started: jax.Array  # [I] given a slot in this call
    steps: jax.Array    # decode steps run


def _prefill(k: _Call, st: _Slots, rows_R, slots_R) -> _Slots:
    """Prefill responses `rows_R` into slots `slots_R` (cache rows, last hidden states, new
    prompt routes): started ones over S slots, new ones over P (the static sampler's program)."""
    cfg, p, s, r, q = k.cfg, k.p, k.s, rows_R.shape[0], st.q
    progress_R = q.progress_I[rows_R]

    def over(width):
        attn_RxW = (q.prompt_mask_IxS | q.completion_IxS)[rows_R, :width]
        h, aux = tf.forward(k.prepared, q.tokens_IxS[rows_R, :width], cfg,
                            attention_mask_BxT=attn_RxW, numerics=k.numerics,
                            cache=tf.init_cache(cfg, r, s, k.dtype), mesh=k.mesh)
        # Left padding puts every prompt's last token in slot P − 1.
        last_RxD = jnp.take_along_axis(h, (p - 1 + progress_R)[:, None, None], 1)[:, 0]
        return last_RxD, aux["cache"], aux["routes"][:, :p], aux["route_weights"][:, :p]

    if k.one_prefill and r == k.n:  # one call over a fresh queue
        last_RxD, cache_r, routes_RxP, weights_RxP = over(p)
    else:
        last_RxD, cache_r, routes_RxP, weights_RxP = jax.lax.cond(
            jnp.any(progress_R > 0), lambda: over(s), lambda: over(p))
    axis = 0 if cfg.unroll_layers else 1  # per-layer buffers, or the stacked [L, ...]
    put = lambda big, new: big.at[(slice(None),) * axis + (slots_R,)].set(new)
    cache = {"k": jax.tree.map(put, st.cache["k"], cache_r["k"]),
             "v": jax.tree.map(put, st.cache["v"], cache_r["v"]),
             "mask": st.cache["mask"].at[slots_R].set(cache_r["mask"]),
             "index": st.cache["index"].at[slots_R].set(p + progress_R)}
    new_RxPx1x1 = ((progress_R == 0)[:, None] & q.prompt_mask_IxS[rows_R, :p])[..., None, None]
    q = q._replace(
        routes_IxSxLxK=q.routes_IxSxLxK.at[rows_R, :p].set(
            jnp.where(new_RxPx1x1, routes_RxP, q.routes_IxSxLxK[rows_R, :p])),
        route_weights_IxSxLxK=q.route_weights_IxSxLxK.at[rows_R, :p].set(
            jnp.where(new_RxPx1x1, weights_RxP, q.route_weights_IxSxLxK[rows_R, :p])))
    return st._replace(q=q, cache=cache, hidden=st.hidden.at[slots_R].set(last_RxD),
                       resp=st.resp.at[slots_R].set(rows_R),
                       started=st.started.at[rows_R].set(True),
                       done=st.done.at[slots_R].set(False))


def _next_logits(k: _Call, hidden_nxD, first_n):
    """Each slot's next-token log-probs (rollout.next_logprobs): a first token's from the
    prefill's weights, later ones from the decode loop's (the serving layout's, if separate)."""
    logits = lambda w, rules=None: rollout_lib.next_logprobs(
        w, hidden_nxD, k.cfg, k.sampling, k.numerics, k.mesh, rules, k.logprob_impl)
    if k.d_params is k.prepared:
        return logits(k.prepared)
    return jax.lax.cond(jnp.any(first_n),
                        lambda: jnp.where(first_n[:, None], logits(k.prepared),
                                          logits(k.d_params, k.d_rules)),
                        lambda: logits(k.d_params, k.d_rules))


def _draw(row_key, i, logp_V):
    return jax.random.categorical(jax.random.fold_in(row_key, i), logp_V)


def _decode_step(k: _Call, st: _Slots) -> _Slots:
    """One token for every slot that holds a running response, written into the queue."""
    p, s, c, q, live = k.p, k.s, k.c, st.q, ~st.done
    i_n = q.progress_I[st.resp]
    logp_nxV = _next_logits(k, st.hidden, i_n == 0)
    tok = jax.vmap(_draw)(k.keys_I[st.resp], i_n, logp_nxV)
    tok = jnp.where(live, tok, k.pad_id).astype(jnp.int32)
    lp = jnp.take_along_axis(logp_nxV, tok[:, None], axis=1)[:, 0]
    stop = jnp.any(tok[:, None] == k.stops_Z[None, :], axis=1)
    # As in the static sampler: a token is fed back unless it is a stop id or padding;
    # the C-th is fed too (one shape) but its routes are never read (-1).
    fed = live & ~stop
    # A free slot (no running response) writes and reads at slot P: its output is
    # dropped, and a ragged decode attention then reads only its prompt's blocks.
    cache = dict(st.cache, index=jnp.where(live, jnp.minimum(p + i_n, s - 1), p))
    h, a = tf.forward(k.d_params, tok[:, None], k.cfg, attention_mask_BxT=fed[:, None],
                      numerics=k.numerics, cache=cache, mesh=k.mesh, rules=k.d_rules)
    recorded_nx1x1 = (fed & (i_n + 1 < c))[:, None, None]
    # Writes of a slot that holds no running response go to row I: dropped.
    row, col = jnp.where(live, st.resp, k.num_i), p + i_n
    put = lambda buf, v: buf.at[row, col].set(v, mode="drop")
    finished = live & (stop | (i_n + 1 >= c))
    q = q._replace(
        tokens_IxS=put(q.tokens_IxS, tok), logp_IxS=put(q.logp_IxS, lp),
        completion_IxS=put(q.completion_IxS, live),
        routes_IxSxLxK=put(q.routes_IxSxLxK, jnp.where(recorded_nx1x1, a["routes"][:, 0], -1)),
        route_weights_IxSxLxK=put(q.route_weights_IxSxLxK, jnp.where(
            recorded_nx1x1, a["route_weights"][:, 0], 0).astype(jnp.float32)),
        version_IxS=put(q.version_IxS, jnp.full((k.n,), k.version, jnp.int32)),
        progress_I=q.progress_I.at[row].set(i_n + 1, mode="drop"),
        finished_I=q.finished_I.at[row].set(finished, mode="drop"),
        stopped_I=q.stopped_I.at[row].set(stop, mode="drop"))
    return st._replace(q=q, cache=a["cache"], hidden=h[:, 0], done=st.done | finished,
                       steps=st.steps + 1)


def _pending(st: _Slots):
    return ~st.q.finished_I & ~st.started


def _refill(k: _Call, st: _Slots) -> _Slots:
    """The lowest free slot takes the next pending response: a 1-row prefill (batch-invariant on
    a mesh: one identical copy per data-parallel device)."""
    copies = invariant_layer.row_splits(k.mesh) if k.cfg.batch_invariant else 1
    return _prefill(k, st, jnp.full((copies,), jnp.argmax(_pending(st))),
                    jnp.full((copies,), jnp.argmax(st.done)))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "numerics", "stops", "pad_id",
                                             "mesh", "need_groups", "group_size", "slots",
                                             "logprob_impl"))
def run(params, queue: Queue, version, *, cfg, sampling, numerics, stops, pad_id, mesh,
        need_groups: int = 0, group_size: int = 1, slots: int = 0,
        logprob_impl: str = "chunked"):
    """(queue advanced, decode steps run) with weights `params` of `version`: slots take
    unfinished responses in queue order (started ones re-prefilled), then decode and refill until
    all are complete or, with `need_groups`, that many groups of `group_size` adjacent responses
    are. `slots`: n (0: `slots_of(sampling, I)`). `logprob_impl`: as `rollout.sample`'s."""
    num_i, s = queue.tokens_IxS.shape
    n, c = min(slots or slots_of(sampling, num_i), num_i), sampling.max_new_tokens
    p = s - c
    need = need_groups or num_i // group_size
    prepared = nx.prepare_params(params, numerics)
    d_params, d_rules = (rollout_lib.serving_layout(params, cfg, numerics, mesh)
                         if sampling.layout == "serve" else (prepared, None))
    dtype = nx.compute_dtype(numerics, cfg.compute_dtype)
    k = _Call(cfg, sampling, numerics, mesh, logprob_impl, pad_id, prepared, d_params,
              d_rules, rollout_lib.row_keys(queue.keys_Ix2, num_i),
              jnp.asarray(stops, jnp.int32), version, n, num_i, s, p, c,
              n == num_i and not need_groups, dtype)
    wanted = lambda st: jnp.sum(jnp.all(st.q.finished_I.reshape(-1, group_size),
                                        axis=1)) < need
    state = _Slots(queue, dict(tf.init_cache(cfg, n, s, dtype),
                               index=jnp.full((n,), p, jnp.int32)),
                   jnp.zeros((n, cfg.d_model), dtype), jnp.zeros((n,), jnp.int32),
                   jnp.ones((n,), bool), jnp.zeros((num_i,), bool), jnp.zeros((), jnp.int32))
    # The first n unfinished responses in queue order (fewer: the other slots stay free).
    first_n = jnp.nonzero(~queue.finished_I, size=n, fill_value=num_i)[0]
    state = _prefill(k, state, jnp.minimum(first_n, num_i - 1), jnp.arange(n))
    state = state._replace(done=first_n >= num_i, started=state.started & ~queue.finished_I)

    def body(st):
        st = _decode_step(k, st)
        return jax.lax.while_loop(
            lambda st: jnp.any(st.done) & jnp.any(_pending(st)) & wanted(st),
            functools.partial(_refill, k), st)

    if n == num_i:  # a slot per response: nothing is ever refilled
        body = functools.partial(_decode_step, k)

    st = jax.lax.while_loop(lambda st: jnp.any(~st.done) & wanted(st), body, state)
    return st.q, st.steps
