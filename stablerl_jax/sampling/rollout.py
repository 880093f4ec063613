"""The sampling path (the inference engine μ): prefill + KV-cache decode, own numerics.

Letters: B rows (responses), P prompt slots, C completion slots (max_new_tokens), S = P + C
slots, V vocab, L layers, K top-k.

Unlike the trainer's single full-sequence pass, on purpose: own `Numerics` (e.g. FP8 weights,
bf16 activations; converted once per call by `prepare_params`), and a prefill, then one token a
step against an S-slot KV cache in a `lax.while_loop`, until each row has emitted a stop id of
`{eos_id} ∪ stop_ids` ("EOS" below; generation_config.json may list several, e.g. Qwen3's
`<|im_end|>` and `<|endoftext|>`). A row with none in C tokens is *truncated* (`truncated_B`).

Alignment (the trainer relies on it; the hidden state at slot s predicts slot s + 1):
- tokens_BxS: left-padded prompt in [0, P), completion in [P, S), pad_id after EOS.
- logp_mu_BxS[b, s]: log μ of completion token tokens[b, s] under exactly the distribution it was
  drawn from (float32 logits / temperature, then top-k / top-p if on); 0 elsewhere.
- routes_mu_BxSxLxK[b, s]: the experts each layer used when the engine *processed* tokens[b, s];
  -1 where it processed nothing (padding, after EOS, EOS itself and the last sampled token, never
  fed back). All -1 or all recorded per token: a valid `replay_BxTxLxK` for the training forward
  over tokens_BxS (mask prompt_mask | completion_mask).
- route_weights_mu_BxSxLxK[b, s]: their combine weights (float32), 0 where routes_mu is -1, for
  weight replay (`rl.replay_weights`).
- completion_mask_BxS / lengths_B: sampled tokens up to and *including* EOS (an action: its
  log-prob's gradient teaches stopping).

Truncation biases IS weights: logp_mu is then under the *truncated* μ_trunc, the trainer scores
the full softmax π, and excluded tokens are never sampled, so E_{μ_trunc}[π/μ_trunc] = π(support)
< 1 (inside, π/μ_trunc = π(support) · π/μ_full). Leave it off for RL unless that bias is studied.

Layouts (SamplingConfig.layout): 'train' decodes with the trainer's FSDP-sharded weights,
gathering each layer's (and the unembedding) every step. 'serve' reshards them once per call to
`sharding.SERVE_RULES` (`serving_layout`: experts split over every device, the rest replicated,
FP8 as e4m3 + per-channel scales): a decode step then moves only activations
(model/expert_parallel.py). The prefill keeps the training layout: gathers amortize over P tokens
a row, and an exchange of all prompt tokens would need a buffer of every device's tokens. Both
sample the same tokens, log μ and routes (tests/sampling/serve_layout_test.py).

Randomness: row b draws at decode step i from fold_in(key_b, i), key_b its own key ([B] keys, or
one split into B), so its sample depends only on its key, prompt and the weights, not on other
rows or its left padding (up to float reassociation in batched matmuls).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax import sharding, slices
from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.model import invariant, invariant_layer
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf


def sampler_model(model: ModelConfig, sampling: SamplingConfig) -> ModelConfig:
    """`model` with the sampler's own expert dispatch (sampling.dispatch), if it names one."""
    if sampling.dispatch in ("", model.dispatch):
        return model
    return model.replace(dispatch=sampling.dispatch,
                         expert_parallel=model.expert_parallel
                         and sampling.dispatch == "grouped")


class Rollout(NamedTuple):
    """What the sampling engine returns; slot alignment in the module docstring."""

    tokens_BxS: jax.Array           # int32
    prompt_mask_BxS: jax.Array      # bool, real prompt tokens
    completion_mask_BxS: jax.Array  # bool, sampled tokens up to and including EOS
    lengths_B: jax.Array            # int32, completion lengths
    logp_mu_BxS: jax.Array          # float32, 0 outside the completion
    routes_mu_BxSxLxK: jax.Array    # int32, -1 where nothing was processed
    route_weights_mu_BxSxLxK: jax.Array | None = None  # float32, 0 where routes are -1
    truncated_B: jax.Array | None = None  # bool, no stop id in max_new_tokens


def decode_steps(lengths_B, max_batch: int = 0):
    """Decode steps `sample` runs for `lengths_B`: each max_batch pass's longest row, summed."""
    b = lengths_B.shape[0]
    n = b // max_batch if max_batch else 1
    return jnp.sum(jnp.max(lengths_B.reshape(b // n, n), axis=0))


def used_window(used_S, bucket: int) -> tuple[int, int]:
    """`trim`'s [lo, hi): `used_S`'s span grown (leftward first) to a `bucket` multiple ≤ S."""
    used = np.flatnonzero(np.asarray(used_S))
    s = len(used_S)
    if not len(used):
        return 0, s
    lo, hi = int(used[0]), int(used[-1]) + 1
    width = min(-(-(hi - lo) // bucket) * bucket, s)
    lo = max(0, hi - width)
    return lo, lo + width


def trim(rollout: Rollout, lo: int, hi: int) -> Rollout:
    """The rollout on slots [lo, hi); positions count real tokens, so scores stay the same."""
    return Rollout(*[x if x is None or x.ndim == 1 else x[:, lo:hi] for x in rollout])


def sampling_logprobs(logits_BxV, sampling: SamplingConfig):
    """log of the distribution actually sampled: float32 logits / temperature, then
    top-k, then top-p on what is left, renormalized. Excluded tokens get −inf."""
    z = logits_BxV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k and sampling.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, -jnp.inf)
    if sampling.top_p < 1.0:
        srt = jnp.sort(z, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        # Keep a token while the mass above it is still short of top_p (the first always).
        cutoff = jnp.min(jnp.where(before < sampling.top_p, srt, jnp.inf), axis=-1,
                         keepdims=True)
        z = jnp.where(z >= cutoff, z, -jnp.inf)
    return jax.nn.log_softmax(z, axis=-1)


def next_logprobs(params, hidden_BxD, cfg: ModelConfig, sampling: SamplingConfig,
                  numerics: nx.Numerics, mesh=None, rules=None, logprob_impl: str = "chunked"):
    """Next-token log-probs [B, V] float32: `sampling_logprobs` of the logits, or under
    batch-invariant numerics invariant.logprobs_V per row (temperature on the hidden state, no
    truncation; kernel `logprob_impl` if batch-invariant), per device of `mesh` (`rules`)."""
    if cfg.batch_invariant:
        w = tf.unembed_matrix(params, cfg).astype(hidden_BxD.dtype)
        per_row = lambda h, w: invariant.logprobs_V(h, w, sampling.temperature, cfg.row_tile,
                                                    logprob_impl)
        return invariant_layer.on_mesh(per_row, mesh, rules)(hidden_BxD, w)
    return sampling_logprobs(tf.logits(params, hidden_BxD[:, None], cfg)[:, 0], sampling)


def stop_set(eos_id: int, stop_ids=()) -> tuple[int, ...]:
    """Sorted unique stop ids: `eos_id` (-1: none), `stop_ids`; static, one sampler per set."""
    return tuple(sorted({int(i) for i in (eos_id, *stop_ids) if int(i) >= 0}))


def truncated_rows(tokens_BxS, completion_mask_BxS, stop_ids, max_new_tokens: int):
    """[B] bool: rows at max_new_tokens not ending on a stop id (files lacking `truncated_B`)."""
    tokens_BxS, comp_BxS = np.asarray(tokens_BxS), np.asarray(completion_mask_BxS, bool)
    lengths_B = comp_BxS.sum(axis=1)
    last_B = np.where(comp_BxS.any(axis=1),
                      tokens_BxS[np.arange(len(tokens_BxS)),
                                 comp_BxS.shape[1] - 1 - np.argmax(comp_BxS[:, ::-1], axis=1)],
                      -1)
    return (lengths_B >= max_new_tokens) & ~np.isin(last_B, list(stop_ids))


def validate_inputs(prompts, mask, cfg: ModelConfig, sampling: SamplingConfig, eos_id,
                    pad_id, stop_ids=()):
    """The sampler's inputs: shapes, dtypes, ids and left padding (names the field)."""
    if prompts.ndim != 2 or tuple(mask.shape) != tuple(prompts.shape):
        raise ValueError(f"prompt_tokens / prompt_mask: must both be [B, P], got "
                         f"{tuple(prompts.shape)} and {tuple(mask.shape)}")
    if not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens: must be integer token ids, got {prompts.dtype}")
    need = prompts.shape[1] + sampling.max_new_tokens
    if need > cfg.max_seq_len:
        raise ValueError(f"prompt length {prompts.shape[1]} + max_new_tokens "
                         f"{sampling.max_new_tokens} = {need} exceeds the cache "
                         f"(ModelConfig.max_seq_len={cfg.max_seq_len}); shorten the prompt, "
                         "lower SamplingConfig.max_new_tokens or raise max_seq_len")
    for name, v, lowest in (("eos_id", eos_id, -1), ("pad_id", pad_id, 0),
                            *((f"stop_ids[{i}]", v, 0) for i, v in enumerate(stop_ids))):
        if not (isinstance(v, (int, np.integer)) and lowest <= v < cfg.vocab_size):
            raise ValueError(f"{name}={v!r} must be a token id of the vocabulary "
                             f"[0, vocab_size={cfg.vocab_size}) (eos_id may be -1: no EOS, "
                             "every row decodes all max_new_tokens); take it from the "
                             "tokenizer")
    if isinstance(mask, jax.core.Tracer):
        return
    m = np.asarray(mask).astype(bool)
    if not m.any(axis=1).all():
        raise ValueError("prompt_mask: every row needs at least one real (True) token")
    if not m[:, -1].all() or (np.diff(m.astype(np.int8), axis=1) < 0).any():
        raise ValueError("prompt_mask: prompts must be left-padded (padding first, then "
                         "the real tokens up to the last slot)")


def row_keys(key, b: int):
    """[B] typed keys: one key split, or [B] keys; raw uint32 (jax.random.PRNGKey) is wrapped."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.random.split(key, b)
    if key.shape != (b,):
        raise ValueError(f"key: one key or one per row ([B]=[{b}]), got key shape "
                         f"{tuple(key.shape)}")
    return key


def sample(params, prompt_tokens_BxP, prompt_mask_BxP, key, cfg: ModelConfig,
           sampling: SamplingConfig, numerics: nx.Numerics, *, eos_id: int,
           pad_id: int, stop_ids=(), mesh=None, logprob_impl: str = "chunked") -> Rollout:
    """Sample completions of left-padded prompts (inputs validated; prefill + decode jitted, cfg,
    sampling, numerics, stop / pad ids static). Rows stop on `eos_id` or `stop_ids` (`stop_set`;
    none: max_new_tokens), `pad_id` after. `sampling.max_batch` < B: strided slices (`lax.map`,
    slices.py), same samples. `mesh`: the expert FFN's devices. `sampling.layout='serve'`: decode
    on `serving_layout`'s weights. `logprob_impl`: RLConfig.logprob_impl, sampled with if
    batch-invariant (`next_logprobs`)."""
    validate_inputs(prompt_tokens_BxP, prompt_mask_BxP, cfg, sampling, eos_id, pad_id,
                    tuple(stop_ids))
    b = prompt_tokens_BxP.shape[0]
    if sampling.max_batch and b % sampling.max_batch:
        raise ValueError(f"sampling.max_batch={sampling.max_batch} must divide the batch of "
                         f"{b} rows")
    return _sample(params, prompt_tokens_BxP.astype(jnp.int32),
                   prompt_mask_BxP.astype(bool), key, cfg, sampling, numerics,
                   stop_set(eos_id, stop_ids), int(pad_id), mesh, logprob_impl)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "numerics", "stops", "pad_id",
                                             "mesh", "logprob_impl"))
def _sample(params, prompts, pmask, key, cfg, sampling, numerics, stops, pad_id, mesh,
            logprob_impl="chunked"):
    b = prompts.shape[0]
    n = b // sampling.max_batch if sampling.max_batch else 1
    prepared = nx.prepare_params(params, numerics)
    layout = serving_layout(params, cfg, numerics, mesh) if sampling.layout == "serve" \
        else None
    decode = lambda rows: _decode(prepared, *rows, cfg, sampling, numerics, stops, pad_id,
                                  mesh, layout, logprob_impl)
    return slices.map_slices(decode, (prompts, pmask, row_keys(key, b)), n,
                             "sampling.max_batch")


def serving_layout(params, cfg: ModelConfig, numerics: nx.Numerics, mesh):
    """(weights, rules) of the serve-layout decode loop: `prepare_params`' weights (FP8 as e4m3 +
    scales) constrained once to `sharding.serve_rules`' shardings. No mesh: rules None."""
    weights = nx.prepare_params(params, numerics, keep_quantized=True)
    if mesh is None:
        return weights, None
    rules = sharding.serve_rules(cfg.expert_parallel)
    # In steps the partitioner takes without replicating a whole expert weight (one
    # jump makes it replicate first): the first step unshards the embed dim (each
    # device gathers only its `expert` shard's experts), each later one adds a mesh
    # axis to the expert dim, a local slice.
    ex = rules["experts"] or ()
    for step in [{**rules, "experts": ex[:i]} for i in range(1, len(ex) + 1)] or [rules]:
        weights = jax.lax.with_sharding_constraint(
            weights, serving_shardings(weights, cfg, mesh, step))
    return weights, rules


def serving_shardings(weights, cfg: ModelConfig, mesh, rules: dict):
    """NamedShardings of the engine's weights (`prepare_params`' form) under `rules`."""
    axes = tf.param_logical_axes(cfg)
    axes["layers"] = {k: nx.axes_like(weights["layers"][k], a)
                      for k, a in axes["layers"].items()}
    return sharding.tree_shardings(axes, weights, mesh, rules)


def _decode(params, prompts, pmask, keys_B, cfg, sampling, numerics, stops, pad_id, mesh,
            layout=None, logprob_impl="chunked"):
    """Prefill + decode of one batch of prepared rows; `stops`: sorted ids (`stop_set`);
    `layout`: the decode loop's (weights, sharding rules) (`serving_layout`), None: `params`."""
    d_params, d_rules = layout if layout is not None else (params, None)
    stops_Z = jnp.asarray(stops, jnp.int32)  # Z stop ids (may be 0)
    is_stop = lambda tok_B: jnp.any(tok_B[:, None] == stops_Z[None, :], axis=1)
    b, p = prompts.shape
    n, s = sampling.max_new_tokens, p + sampling.max_new_tokens
    dtype = nx.compute_dtype(numerics, cfg.compute_dtype)
    cache = tf.init_cache(cfg, b, s, dtype)
    hidden, aux = tf.forward(params, prompts, cfg, attention_mask_BxT=pmask, numerics=numerics,
                             cache=cache, mesh=mesh)
    routes_BxSxLxK = jnp.full((b, s, cfg.num_layers, cfg.top_k), -1, jnp.int32)
    routes_BxSxLxK = routes_BxSxLxK.at[:, :p].set(
        jnp.where(pmask[:, :, None, None], aux["routes"], -1))
    weights_BxSxLxK = jnp.zeros(routes_BxSxLxK.shape, aux["route_weights"].dtype)
    weights_BxSxLxK = weights_BxSxLxK.at[:, :p].set(
        jnp.where(pmask[:, :, None, None], aux["route_weights"], 0))
    state = {
        "i": jnp.zeros((), jnp.int32),
        "cache": aux["cache"],
        # Left padding puts every row's last prompt token in slot P − 1.
        "logp_V": next_logprobs(params, hidden[:, -1], cfg, sampling, numerics, mesh,
                                logprob_impl=logprob_impl),
        "tokens": jnp.full((b, s), pad_id, jnp.int32).at[:, :p].set(prompts),
        "logp": jnp.zeros((b, s), jnp.float32),
        "completion": jnp.zeros((b, s), bool),
        "routes": routes_BxSxLxK,
        "route_weights": weights_BxSxLxK,
        "done": jnp.zeros((b,), bool),
    }

    def draw(row_key, i, logp_V):
        return jax.random.categorical(jax.random.fold_in(row_key, i), logp_V)

    def body(st):
        i = st["i"]
        slot = p + i
        logp_BxV = st["logp_V"]
        tok = jax.vmap(draw, in_axes=(0, None, 0))(keys_B, i, logp_BxV)
        live = ~st["done"]
        tok = jnp.where(live, tok, pad_id).astype(jnp.int32)
        lp = jnp.take_along_axis(logp_BxV, tok[:, None], axis=1)[:, 0]
        # Feed the token back unless it is a stop id or padding. The C-th token is fed too
        # (one shape for every step) but nothing reads its output, so its routes are -1.
        stop = is_stop(tok)
        fed = live & ~stop
        h, a = tf.forward(d_params, tok[:, None], cfg, attention_mask_BxT=fed[:, None],
                          numerics=numerics, cache=st["cache"], mesh=mesh, rules=d_rules)
        recorded_Bx1x1 = fed[:, None, None] & (i + 1 < n)
        step_routes_BxLxK = jnp.where(recorded_Bx1x1, a["routes"][:, 0], -1)
        step_weights_BxLxK = jnp.where(recorded_Bx1x1, a["route_weights"][:, 0], 0)
        return dict(st, i=i + 1, cache=a["cache"],
                    logp_V=next_logprobs(d_params, h[:, 0], cfg, sampling, numerics, mesh,
                                         d_rules, logprob_impl),
                    tokens=st["tokens"].at[:, slot].set(tok),
                    logp=st["logp"].at[:, slot].set(jnp.where(live, lp, 0.0)),
                    completion=st["completion"].at[:, slot].set(live),
                    routes=st["routes"].at[:, slot].set(step_routes_BxLxK),
                    route_weights=st["route_weights"].at[:, slot].set(step_weights_BxLxK),
                    done=st["done"] | (live & stop))

    st = jax.lax.while_loop(lambda st: (st["i"] < n) & ~jnp.all(st["done"]), body, state)
    completion = st["completion"]
    return Rollout(tokens_BxS=st["tokens"],
                   prompt_mask_BxS=jnp.zeros((b, s), bool).at[:, :p].set(pmask),
                   completion_mask_BxS=completion,
                   lengths_B=jnp.sum(completion, axis=1, dtype=jnp.int32),
                   logp_mu_BxS=st["logp"],
                   routes_mu_BxSxLxK=st["routes"],
                   route_weights_mu_BxSxLxK=st["route_weights"],
                   truncated_B=~st["done"])
