"""Continuous batching (stablerl_jax/sampling/continuous.py): the static sampler's responses, bit for
bit, in fewer decode steps when lengths differ; every numerics preset, cache layout and
dispatch the static sampler has."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import LAMBDA, assert_close, engine_chain

from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import sampler_schedules
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as ro

CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64, max_seq_len=40,
                  moe_tile=16)
EOS, PAD = 2, 0
B, P, C = 16, 12, 20


@functools.lru_cache(maxsize=None)
def _setup(eos_bias=3.0):
    """Params whose EOS logit is raised by `eos_bias` · |h_0| (so lengths spread over
    [1, C]), and left-padded prompts (0, 3, 6 or 9 slots of padding)."""
    params = tf.init_params(jax.random.key(0), CFG)
    params["unembed"] = params["unembed"].at[0, EOS].add(eos_bias)
    prompts = jax.random.randint(jax.random.key(1), (B, P), 3, CFG.vocab_size)
    pad = (jnp.arange(B) % 4) * 3
    mask = jnp.arange(P)[None, :] >= pad[:, None]
    return params, jnp.where(mask, prompts, PAD), mask


def static_steps(lengths_B, slots: int) -> int:
    """Decode steps of the static sampler: each strided slice runs to its longest row."""
    lengths_B = np.asarray(lengths_B)
    n = len(lengths_B) // slots
    return int(sum(lengths_B[i::n].max() for i in range(n)))


def _both(cfg=CFG, preset="fp8", slots=4, **sampling_kw):
    params, prompts, mask = _setup()
    sampling = SamplingConfig(max_new_tokens=C, max_batch=slots, **sampling_kw)
    numerics = nx.numerics_preset(preset)
    kw = dict(eos_id=EOS, pad_id=PAD)
    static = ro.sample(params, prompts, mask, jax.random.key(5), cfg, sampling, numerics, **kw)
    cont, steps = continuous.sample(params, prompts, mask, jax.random.key(5), cfg, sampling,
                                    numerics, with_steps=True, **kw)
    return static, cont, int(steps)


def assert_same_rollout(a: ro.Rollout, b: ro.Rollout):
    for name, x, y in zip(a._fields, a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_continuous_returns_the_static_rollout_bit_for_bit(slots):
    static, cont, steps = _both(slots=slots)
    assert_same_rollout(static, cont)
    lengths = np.asarray(static.lengths_B)
    assert len(set(lengths.tolist())) > 3, "the test needs lengths that differ"
    assert np.asarray(static.truncated_B).any() and not np.asarray(static.truncated_B).all()
    # Never fewer steps than the work allows; fewer than the static passes when a slot
    # holds several responses. One slot: the responses run one after another in both
    # (Σ lengths); one slot per row: nothing to refill (the longest row).
    assert steps >= -(-lengths.sum() // slots) and steps >= lengths.max()
    # The schedule the pod estimates price (stablerl_jax/pod/sampler_schedules.py) is this
    # sampler's.
    assert steps == sampler_schedules.continuous(lengths, slots).runs.steps
    assert sampler_schedules.static(lengths, slots).runs.steps == static_steps(lengths, slots)
    expected = {1: lengths.sum(), 16: lengths.max()}
    if slots in expected:
        assert steps == expected[slots] == static_steps(lengths, slots)
    else:
        assert steps < static_steps(lengths, slots)


@pytest.mark.parametrize("variant", [
    dict(cfg=CFG.replace(kv_cache_layout="bksd", decode_block=8)),
    dict(cfg=CFG.replace(unroll_layers=True, kv_cache_layout="bksd"), dispatch="dense"),
    pytest.param(dict(top_k=8, temperature=0.7), marks=pytest.mark.slow),
    pytest.param(dict(preset="bf16"), marks=pytest.mark.slow),
])
def test_continuous_matches_static_across_layouts_and_numerics(variant):
    static, cont, _ = _both(**variant)
    assert_same_rollout(static, cont)


def test_float32_engine_samples_the_same_tokens_and_routes():
    # With float32 weights and activations (the `exact` engine) a row's log-probs come
    # out of differently fused programs (a prefill inside the decode loop, rows at other
    # slots) and may differ in the last bits: the same tokens and experts, log μ and
    # route weights within the rounding bound of the chain (tests/tolerance.py). The
    # FP8 and bf16 engines, the ones RL samples with, agree bit for bit (above).
    static, cont, _ = _both(preset="exact")
    for name in ("tokens_BxS", "completion_mask_BxS", "lengths_B", "routes_mu_BxSxLxK",
                 "truncated_B"):
        np.testing.assert_array_equal(getattr(static, name), getattr(cont, name), name)
    for name in ("logp_mu_BxS", "route_weights_mu_BxSxLxK"):
        assert_close(getattr(cont, name), getattr(static, name), n=engine_chain(CFG, P + C),
                     lam=LAMBDA, scale="max")


def test_bad_inputs_are_refused_as_by_the_static_sampler():
    params, prompts, mask = _setup()
    sampling = SamplingConfig(max_new_tokens=C, max_batch=4)
    with pytest.raises(ValueError, match="left-padded"):
        continuous.sample(params, prompts, mask[:, ::-1], jax.random.key(0), CFG, sampling,
                          nx.numerics_preset("fp8"), eos_id=EOS, pad_id=PAD)


def test_carried_responses_record_mu_and_routes_of_the_version_that_drew_each_token():
    # Partial rollouts: a queue decoded with version 0's weights until 2 of its 8 groups
    # are complete, then continued with version 1's (the unfinished responses
    # re-prefilled). Every token's log μ and routes must be those of a full-sequence
    # pass of the weights of the version recorded for it (the `exact` engine computes
    # what the training path computes, tests/sampling/rollout_test.py).
    params, prompts, mask = _setup()
    later = jax.tree.map(lambda w: w * 1.05, params)
    sampling = SamplingConfig(max_new_tokens=C, max_batch=4)
    kw = dict(cfg=CFG, sampling=sampling, numerics=nx.numerics_preset("exact"),
              stops=ro.stop_set(EOS), pad_id=PAD, mesh=None, group_size=2)
    queue = continuous.new_queue(prompts, mask, jax.random.key(5), CFG, sampling, PAD)
    queue, _ = continuous.run(params, queue, 0, need_groups=2, **kw)
    carried = np.asarray(queue.progress_I > 0) & ~np.asarray(queue.finished_I)
    assert carried.any() and not np.asarray(queue.finished_I).all()
    assert np.asarray(queue.finished_I).reshape(-1, 2).all(1).sum() >= 2
    queue, _ = continuous.run(later, queue, 1, need_groups=0, **kw)
    assert np.asarray(queue.finished_I).all()
    version = np.asarray(queue.version_IxS)
    comp = np.asarray(queue.completion_IxS)
    assert ((version >= 0) == comp).all()
    assert ((version == 0).any(1) & (version == 1).any(1)).any(), "a response spans both"
    r = continuous.to_rollout(queue)
    attn = r.prompt_mask_BxS | r.completion_mask_BxS
    score = jax.jit(policy_logprobs, static_argnames="cfg")
    routes_mu = np.asarray(r.routes_mu_BxSxLxK)
    for v, w in enumerate((params, later)):
        logp_pi_BxT, _, aux = score(w, r.tokens_BxS, attn, cfg=CFG)
        mine = version[:, 1:] == v  # tokens[:, t + 1] drawn by version v
        assert_close(np.where(mine, logp_pi_BxT, 0), np.where(mine, r.logp_mu_BxS[:, 1:], 0),
                     n=engine_chain(CFG, P + C), lam=LAMBDA, scale="max")
        # The routes recorded when version v fed a token back.
        fed = (version[:, :-1] == v)[..., None, None] & (routes_mu[:, :-1] >= 0)
        np.testing.assert_array_equal(np.where(fed, aux["routes"], -1),
                                      np.where(fed, routes_mu[:, :-1], -1))
        # A prompt's routes are recorded once, by the version that prefilled it first:
        # the version of the response's first token.
        pm = (np.asarray(r.prompt_mask_BxS) & (version[:, P:P + 1] == v))[..., None, None]
        np.testing.assert_array_equal(np.where(pm[:, :-1], aux["routes"], -1),
                                      np.where(pm[:, :-1], routes_mu[:, :-1], -1))


def test_slots_given_to_run_override_max_batch():
    # Partial rollouts hold more responses than slots: `run(slots=n)` decodes n rows at a
    # time whatever sampling.max_batch says (0 would give every queued response a slot).
    params, prompts, mask = _setup()
    kw = dict(cfg=CFG, numerics=nx.numerics_preset("fp8"), stops=ro.stop_set(EOS), pad_id=PAD,
              mesh=None)
    every = SamplingConfig(max_new_tokens=C)
    queue = continuous.new_queue(prompts, mask, jax.random.key(5), CFG, every, PAD)
    got, steps = continuous.run(params, queue, 0, sampling=every, slots=4, **kw)
    want, want_steps = continuous.sample(params, prompts, mask, jax.random.key(5), CFG,
                                         every.replace(max_batch=4), kw["numerics"],
                                         eos_id=EOS, pad_id=PAD, with_steps=True)
    assert int(steps) == int(want_steps) < C * B // 4
    assert_same_rollout(continuous.to_rollout(got), want)
