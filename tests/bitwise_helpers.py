"""The sampler against the trainer under batch-invariant numerics: a tiny model, left-
padded prompts, and the check that what the sampler recorded is the trainer's, bit for
bit (tests/model/invariant_test.py, tests/kernels/token_attention_test.py)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg

from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import rollout as ro


def model(dtype, **kw):
    return dataclasses.replace(tiny_cfg().model, compute_dtype=dtype, init_std=0.2,
                               batch_invariant=True, **kw)


def prompts(b=6, p=7, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, p - 1, b)
    prompts, pmask = np.zeros((b, p), np.int32), np.zeros((b, p), bool)
    for i, n in enumerate(lens):
        prompts[i, p - n:] = rng.integers(4, 64, n)
        pmask[i, p - n:] = True
    return jnp.asarray(prompts), jnp.asarray(pmask)


def sample(m, sampling, prompts, pmask, sampler=ro.sample):
    params = tf.init_params(jax.random.key(0), m)
    r = sampler(params, prompts, pmask, jax.random.key(1), m, sampling,
                nx.of_sampling(sampling, 0), eos_id=EOS_ID, pad_id=PAD_ID)
    return params, r


def assert_bitwise(params, r, m, temperature, replay=False, impl="chunked"):
    """log μ = log π_old, IS weight exactly 1, k1 exactly 0, and the sampler's experts
    and gate weights are the trainer's, on every token (`impl`: the trainer's fused
    log-prob row)."""
    attn = r.prompt_mask_BxS | r.completion_mask_BxS
    lp, _, aux = policy_logprobs(params, r.tokens_BxS, attn, m, temperature=temperature,
                                 replay_BxTxLxK=r.routes_mu_BxSxLxK[:, :-1] if replay else None,
                                 impl=impl)
    comp = np.asarray(r.completion_mask_BxS[:, 1:])
    mu, pi = np.asarray(r.logp_mu_BxS[:, 1:])[comp], np.asarray(lp)[comp]
    assert comp.sum() > 20 and np.array_equal(mu, pi), np.abs(mu - pi).max()
    assert np.array_equal(np.exp(pi - mu), np.ones_like(mu))
    assert np.array_equal(mu - pi, np.zeros_like(mu))
    routes_mu = np.asarray(r.routes_mu_BxSxLxK[:, :-1])
    rec = routes_mu[..., 0] >= 0
    assert rec.sum() > 20
    assert np.array_equal(routes_mu[rec], np.asarray(aux["routes"])[rec])
    assert np.array_equal(np.asarray(r.route_weights_mu_BxSxLxK[:, :-1])[rec],
                          np.asarray(aux["route_weights"])[rec])
    return np.asarray(lp)


def assert_zero_mismatch_run(cfg, workdir: str, steps: int = 2):
    """Run `cfg` (a bitwise RL config) in `workdir`: every one of its `steps` logged
    steps has a mismatch and a routing-mismatch rate of exactly 0 and IS weights of
    exactly 1."""
    from stablerl_jax.rl import loop
    from stablerl_jax.runs.metrics_io import read_metrics
    loop.run(cfg, workdir, progress=False)
    rows = [r for r in read_metrics(workdir) if r["step"] > 0]
    assert len(rows) == steps
    for r in rows:
        assert r["mismatch/abs_logp_gap_max"] == 0.0 and r["routing/mismatch_rate"] == 0.0
        assert r["is/weight_max"] == r["is/weight_min"] == 1.0, r
