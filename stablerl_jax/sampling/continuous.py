"""Continuous batching: the sampler that refills a finished row's slot with the next response.

Letters: I responses (the queue, in row order), n slots (rows decoded at once:
sampling.max_batch, or I), P prompt slots, C completion slots (max_new_tokens),
S = P + C, V vocab, L layers, K top-k.

The static sampler (rollout.py) decodes a slice of rows until its longest row stops;
a row that stopped keeps its slot, and its share of every later step's work, doing
nothing. Here a slot whose response stopped (or reached C tokens) takes the next
pending response of the queue before the next decode step: its prompt is prefilled
alone into that slot's row of the KV cache (one [1, P] forward), and its first token is
drawn in the next step. The first n responses start together (one [n, P] prefill).
Slots are refilled in ascending order; the sampler ends when all I responses are
complete. `stablerl_jax.pod.sampler_schedules` simulates exactly this schedule.

Every slot row keeps the static layout (prompt left-padded in [0, P), completion from
slot P), but the rows are at different slots: the KV cache carries one write index
per row (`tf.forward` with a [n] `cache["index"]`) and a decode step's attention reads
key blocks up to the largest row's slot.

Exactness. Response r draws the token at its completion position i from
fold_in(key_r, i), where key_r is row r's key of the static sampler (`rollout.row_keys`),
and no quantity of a row depends on the other rows of the batch: its prefill and decode
steps compute its row alone. So a response's tokens, log μ, routes and weights are the
static sampler's, in the same row order, after fewer decode steps when the lengths
differ, as far as the matmul kernels round a row alike whatever the batch around it.
On CPU the FP8 and bf16 engines agree bit for bit with prefills of up to 32 rows
(tests/sampling/continuous_test.py; docs/records/benchmarks.md, "Samplers side by side"); a refill's
[1, P] prefill can round differently from a pass's [64, P] one, and a response started
by a refill may then draw another token (another sample of the same distribution, its
log μ the one it was drawn from). With float32 weights and activations the differently
fused programs round a log-prob's last bits differently even at small sizes, while
tokens and routes agree. Alignment of every field: rollout.py's module docstring.
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
    """The responses a continuous sampler works through; every leaf is [I, ...], in queue
    order (a group's G responses are adjacent). Slot alignment as in a Rollout.
    `version_IxS` is the parameter version that generated each completion token (-1
    elsewhere); `progress_I` the tokens generated so far; `finished_I` complete
    (stopped or C tokens); `stopped_I` ended on a stop id. Partial rollouts carry the
    unfinished ones into the next step's queue (rl/inflight.py)."""

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
    """A queue of responses not yet started, one per prompt row; `key`: one key (split
    into I, as the static sampler splits it) or [I] keys."""
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
    """`rollout.sample`'s Rollout (same arguments, same rows, same values), by continuous
    batching over `slots_of(sampling, B)` slots. `with_steps`: return (Rollout, the
    number of decode steps run) instead."""
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
    """Responses `rows_R` prefilled into slots `slots_R` (their cache rows and last
    hidden states; a new response's prompt routes). A response with tokens already is
    prefilled over its prompt and completion so far (S slots), a new one over its prompt
    (P slots): one program each, the second the static sampler's."""
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
    """The log-probs a response's next token is drawn from (rollout.next_logprobs): its
    first token's from the prefill's weights, the rest from the decode loop's (the
    serving layout's, when it has its own)."""
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
    """The lowest free slot takes the next pending response (one 1-row prefill; with
    batch-invariant numerics on a mesh, whose devices each prefill their own rows, the
    row repeated once per data-parallel device: the copies write the same bits)."""
    copies = invariant_layer.row_splits(k.mesh) if k.cfg.batch_invariant else 1
    return _prefill(k, st, jnp.full((copies,), jnp.argmax(_pending(st))),
                    jnp.full((copies,), jnp.argmax(st.done)))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "numerics", "stops", "pad_id",
                                             "mesh", "need_groups", "group_size", "slots",
                                             "logprob_impl"))
def run(params, queue: Queue, version, *, cfg, sampling, numerics, stops, pad_id, mesh,
        need_groups: int = 0, group_size: int = 1, slots: int = 0,
        logprob_impl: str = "chunked"):
    """(the queue advanced, decode steps run) with the weights `params` of `version`.

    Slots are filled with the queue's unfinished responses in queue order (those with
    tokens already, from an earlier call, re-prefilled over prompt + completion so far
    with these weights); then decode steps and refills (module docstring) until every
    response is complete or, with `need_groups`, until that many groups of `group_size`
    adjacent responses are complete (partial rollouts: the rest stay unfinished).
    `slots`: n (0: `slots_of(sampling, I)`; partial rollouts pass the step's, whose
    queue holds more responses than slots). `logprob_impl`: as `rollout.sample`'s."""
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
