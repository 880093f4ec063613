"""Continuous batching: the sampler that refills a finished row's slot with the next response.

Letters: N responses (the queue, in row order), n slots (rows decoded at once:
sampling.max_batch, or N), P prompt slots, C completion slots (max_new_tokens),
S = P + C, V vocab, L layers, K top-k.

The static sampler (rollout.py) decodes a slice of rows until its longest row stops;
a row that stopped keeps its slot, and its share of every later step's work, doing
nothing. Here a slot whose response stopped (or reached C tokens) takes the next
pending response of the queue before the next decode step: its prompt is prefilled
alone into that slot's row of the KV cache (one [1, P] forward), and its first token is
drawn in the next step. The first n responses start together (one [n, P] prefill).
Slots are refilled in ascending order; the sampler ends when all N responses are
complete. `stablerl_jax.schedule` simulates exactly this schedule.

Every slot row keeps the static layout (prompt left-padded in [0, P), completion from
slot P), but the rows are at different slots: the KV cache carries one write index
per row (`tf.forward` with a [n] `cache["index"]`) and a decode step's attention reads
key blocks up to the largest row's slot.

Exactness. Response r draws the token at its completion position i from
fold_in(key_r, i), where key_r is row r's key of the static sampler (`rollout.row_keys`),
and its prefill and decode steps compute its row alone: no quantity of a row depends on
the other rows of the batch. So a response's tokens, log μ, routes and weights depend
only on (its key, its prompt, the weights), never on the slot it ran in or on the
responses beside it, and the result is the static sampler's Rollout, in the same row
order, after fewer decode steps when the lengths differ (tests/continuous_test.py: bit
for bit on CPU with the FP8 and bf16 engines; with float32 weights and activations the
differently fused programs may round a log-prob's last bits differently, while tokens
and routes are the same). Alignment of every field: rollout.py's module docstring.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stablerl_jax import rollout as rollout_lib
from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf


def slots_of(sampling: SamplingConfig, rows: int) -> int:
    """n: the rows decoded at once (sampling.max_batch; 0 = every row)."""
    return min(sampling.max_batch or rows, rows)


def sample(params, prompt_tokens_BxP, prompt_mask_BxP, key, cfg: ModelConfig,
           sampling: SamplingConfig, numerics: nx.Numerics, *, eos_id: int, pad_id: int,
           stop_ids=(), mesh=None, with_steps: bool = False):
    """`rollout.sample`'s Rollout (same arguments, same rows, same values), by continuous
    batching over `slots_of(sampling, B)` slots. `with_steps`: return (Rollout, the
    number of decode steps run) instead."""
    rollout_lib.validate_inputs(prompt_tokens_BxP, prompt_mask_BxP, cfg, sampling, eos_id,
                                pad_id, tuple(stop_ids))
    out, steps = _sample(params, prompt_tokens_BxP.astype(jnp.int32),
                         prompt_mask_BxP.astype(bool), key, cfg, sampling, numerics,
                         rollout_lib.stop_set(eos_id, stop_ids), int(pad_id), mesh)
    return (out, steps) if with_steps else out


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "numerics", "stops", "pad_id",
                                             "mesh"))
def _sample(params, prompts_NxP, pmask_NxP, key, cfg, sampling, numerics, stops, pad_id,
            mesh):
    big_n, p = prompts_NxP.shape
    n, c = slots_of(sampling, big_n), sampling.max_new_tokens
    s = p + c
    keys_N = rollout_lib.row_keys(key, big_n)
    prepared = nx.prepare_params(params, numerics)
    d_params, d_rules = (rollout_lib.serving_layout(params, cfg, numerics, mesh)
                         if sampling.layout == "serve" else (prepared, None))
    dtype = nx.compute_dtype(numerics, cfg.compute_dtype)
    stops_Z = jnp.asarray(stops, jnp.int32)  # Z stop ids (may be 0)

    def prefill(st, rows_R, slots_R):
        """Responses `rows_R` prefilled into slots `slots_R` (their cache rows, last hidden
        states, prompt routes), each slot reset to the start of its response."""
        r = rows_R.shape[0]
        pm_RxP = pmask_NxP[rows_R]
        h, aux = tf.forward(prepared, prompts_NxP[rows_R], cfg, attention_mask_BxT=pm_RxP,
                            numerics=numerics, cache=tf.init_cache(cfg, r, s, dtype),
                            mesh=mesh)
        axis = 0 if cfg.unroll_layers else 1  # per-layer buffers, or the stacked [L, ...]
        put = lambda big, new: big.at[(slice(None),) * axis + (slots_R,)].set(new)
        cache = st["cache"]
        cache = {"k": jax.tree.map(put, cache["k"], aux["cache"]["k"]),
                 "v": jax.tree.map(put, cache["v"], aux["cache"]["v"]),
                 "mask": cache["mask"].at[slots_R].set(aux["cache"]["mask"]),
                 "index": cache["index"].at[slots_R].set(p)}
        routed = pm_RxP[:, :, None, None]
        return dict(
            st, cache=cache,
            # Left padding puts every prompt's last token in slot P − 1.
            hidden=st["hidden"].at[slots_R].set(h[:, -1]),
            routes=st["routes"].at[rows_R, :p].set(jnp.where(routed, aux["routes"], -1)),
            route_weights=st["route_weights"].at[rows_R, :p].set(
                jnp.where(routed, aux["route_weights"], 0)),
            resp=st["resp"].at[slots_R].set(rows_R),
            i=st["i"].at[slots_R].set(0),
            done=st["done"].at[slots_R].set(False))

    routes_shape = (big_n, s, cfg.num_layers, cfg.top_k)
    weights_dtype = jax.eval_shape(
        lambda: tf.forward(prepared, prompts_NxP[:1], cfg, attention_mask_BxT=pmask_NxP[:1],
                           numerics=numerics)[1]["route_weights"]).dtype
    state = {
        "cache": dict(tf.init_cache(cfg, n, s, dtype), index=jnp.full((n,), p, jnp.int32)),
        # The hidden state each slot's next token is drawn from. Logits are computed
        # for all n slots at once, as the static sampler does for its n rows: a [1, D]
        # row alone would run another matmul kernel (another summation order).
        "hidden": jnp.zeros((n, cfg.d_model), dtype),
        "resp": jnp.zeros((n,), jnp.int32),  # the response each slot holds
        "i": jnp.zeros((n,), jnp.int32),     # tokens that response has generated
        "done": jnp.zeros((n,), bool),       # the slot's response is complete: slot free
        "next": jnp.asarray(n, jnp.int32),   # the first response not yet started
        "steps": jnp.zeros((), jnp.int32),
        "tokens": jnp.full((big_n, s), pad_id, jnp.int32).at[:, :p].set(prompts_NxP),
        "logp": jnp.zeros((big_n, s), jnp.float32),
        "completion": jnp.zeros((big_n, s), bool),
        "routes": jnp.full(routes_shape, -1, jnp.int32),
        "route_weights": jnp.zeros(routes_shape, weights_dtype),
        "stopped": jnp.zeros((big_n,), bool),
    }
    state = prefill(state, jnp.arange(n), jnp.arange(n))

    def draw(row_key, i, logp_V):
        return jax.random.categorical(jax.random.fold_in(row_key, i), logp_V)

    def next_logits(hidden_nxD, i_n):
        """A response's first token is drawn from logits of the prefill's weights, the
        rest from the decode loop's (the serving layout's, when it has its own)."""
        logits = lambda w: tf.logits(w, hidden_nxD[:, None], cfg)[:, 0]
        if d_params is prepared:
            return logits(prepared)
        return jax.lax.cond(jnp.any(i_n == 0),
                            lambda: jnp.where((i_n == 0)[:, None], logits(prepared),
                                              logits(d_params)),
                            lambda: logits(d_params))

    def decode_step(st):
        i_n, live = st["i"], ~st["done"]
        logp_nxV = rollout_lib.sampling_logprobs(next_logits(st["hidden"], i_n), sampling)
        tok = jax.vmap(draw)(keys_N[st["resp"]], i_n, logp_nxV)
        tok = jnp.where(live, tok, pad_id).astype(jnp.int32)
        lp = jnp.take_along_axis(logp_nxV, tok[:, None], axis=1)[:, 0]
        stop = jnp.any(tok[:, None] == stops_Z[None, :], axis=1)
        # As in the static sampler: a token is fed back unless it is a stop id or
        # padding; the C-th is fed too (one shape) but its routes are never read (-1).
        fed = live & ~stop
        cache = dict(st["cache"], index=jnp.minimum(p + i_n, s - 1))
        h, a = tf.forward(d_params, tok[:, None], cfg, attention_mask_BxT=fed[:, None],
                          numerics=numerics, cache=cache, mesh=mesh, rules=d_rules)
        recorded_nx1x1 = (fed & (i_n + 1 < c))[:, None, None]
        # Writes of a slot that holds no running response go to row N: dropped.
        row, col = jnp.where(live, st["resp"], big_n), p + i_n
        put = lambda buf, v: buf.at[row, col].set(v, mode="drop")
        return dict(
            st, cache=a["cache"], hidden=h[:, 0],
            tokens=put(st["tokens"], tok), logp=put(st["logp"], lp),
            completion=put(st["completion"], live),
            routes=put(st["routes"], jnp.where(recorded_nx1x1, a["routes"][:, 0], -1)),
            route_weights=put(st["route_weights"],
                              jnp.where(recorded_nx1x1, a["route_weights"][:, 0], 0)),
            stopped=st["stopped"].at[row].set(stop, mode="drop"),
            i=i_n + live, done=st["done"] | (live & (stop | (i_n + 1 >= c))),
            steps=st["steps"] + 1)

    def refill(st):
        """The lowest free slot takes the next pending response (one [1, P] prefill)."""
        slot = jnp.argmax(st["done"])
        st = prefill(st, st["next"][None], slot[None])
        return dict(st, next=st["next"] + 1)

    def body(st):
        st = decode_step(st)
        return jax.lax.while_loop(lambda st: jnp.any(st["done"]) & (st["next"] < big_n),
                                  refill, st)

    st = jax.lax.while_loop(lambda st: ~jnp.all(st["done"]), body, state)
    completion = st["completion"]
    return rollout_lib.Rollout(
        tokens_BxS=st["tokens"],
        prompt_mask_BxS=jnp.zeros((big_n, s), bool).at[:, :p].set(pmask_NxP),
        completion_mask_BxS=completion,
        lengths_B=jnp.sum(completion, axis=1, dtype=jnp.int32),
        logp_mu_BxS=st["logp"],
        routes_mu_BxSxLxK=st["routes"],
        route_weights_mu_BxSxLxK=st["route_weights"],
        truncated_B=~st["stopped"]), st["steps"]
