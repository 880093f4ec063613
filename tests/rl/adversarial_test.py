"""Adversarial numerics through the jitted update: 240 random bad batches (log-prob gaps of
±50, NaN / ±inf in rollout or π_old log-probs and in advantages, all-zero masks, empty
completions, equal rewards, huge advantages, invalid replay rows). Whatever comes in, no
non-finite value ever reaches the parameters or the optimizer state, and every update
with a non-finite input on a counted token, or an invalid replay row on a real token, is
counted as skipped."""
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from rl_helpers import EOS_ID, PAD_ID, tiny_cfg

from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import step_fns
from stablerl_jax.rl.engine import Engine

CASES = 240
KINDS = 10  # the mutations of `_mutate`; a case applies 1 to 3 distinct ones in random order
REWARDS = np.array([1, 0, 0, 1, 1, 1, 0, 0], np.float32)
# The counts below hold for any seed except with at most this probability each.
FAILURE_PROBABILITY = 1e-6


@functools.lru_cache(maxsize=None)
def _setup():
    cfg = tiny_cfg(replay="r3", learning_rate=1e-2)
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    params = tf.init_params(jax.random.key(0), cfg.model)
    prompts = jax.random.randint(jax.random.key(1), (8, 8), 4, 60)
    rollout = eng.sample(params, prompts, jnp.ones((8, 8), bool), jax.random.key(2))
    batch, _ = eng.score(params, rollout, REWARDS)
    return cfg, eng, params, jax.tree.map(np.asarray, batch)


def _must_skip(batch, num_experts) -> bool:
    """A non-finite input on a counted token (or the advantage of a response with one), or
    an invalid replay row on a real token that a counted token comes at or after."""
    counted = batch.mask_BxT > 0
    if not (np.all(np.isfinite(batch.rollout_logp_BxT[counted]))
            and np.all(np.isfinite(batch.old_logp_BxT[counted]))
            and np.all(np.isfinite(batch.advantages_B[counted.any(axis=1)]))):
        return True
    r = batch.replay_BxTxLxK
    srt = np.sort(r, axis=-1)
    invalid = (((r < -1) | (r >= num_experts)).any(-1)
               | ((r >= 0).any(-1) & ~(r >= 0).all(-1))
               | ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1)).any(-1)
    last_counted = np.where(counted.any(1), counted.shape[1] - 1 - np.argmax(
        counted[:, ::-1], axis=1), -1)
    positions = np.arange(r.shape[1])[None, :]
    used = batch.attn_BxS[:, :-1] & (positions <= last_counted[:, None])
    return bool((invalid & used).any())


def _mutate(batch, rng, num_experts):
    """A random adversarial variant of `batch`, whether it must be skipped, and the kinds of
    mutation it applied, in order."""
    counted = np.argwhere(batch.mask_BxT > 0)
    real = np.argwhere(batch.attn_BxS[:, :-1])
    fields = batch._asdict()
    kinds = tuple(int(k) for k in rng.choice(KINDS, size=rng.integers(1, 4), replace=False))
    for kind in kinds:
        b, t = counted[rng.integers(len(counted))]
        if kind == 0:    # huge but finite gaps between the engines and the policies
            fields["rollout_logp_BxT"] = fields["rollout_logp_BxT"] + rng.choice([-50, 50]) * (
                rng.uniform(size=batch.mask_BxT.shape) < 0.3)
        elif kind == 1:  # the sampler reports NaN / -inf / +inf for a token it sampled
            x = fields["rollout_logp_BxT"].copy()
            x[b, t] = rng.choice([np.nan, -np.inf, np.inf])
            fields["rollout_logp_BxT"] = x
        elif kind == 2:  # π_old NaN / ±inf on a counted token
            x = fields["old_logp_BxT"].copy()
            x[b, t] = rng.choice([np.nan, -np.inf, np.inf])
            fields["old_logp_BxT"] = x
        elif kind == 3:  # everything masked
            fields["mask_BxT"] = np.zeros_like(batch.mask_BxT)
        elif kind == 4:  # empty completions in some rows
            m = fields["mask_BxT"].copy()
            m[rng.uniform(size=m.shape[0]) < 0.5] = 0.0
            fields["mask_BxT"] = m
        elif kind == 5:  # equal rewards: no learning signal
            fields["advantages_B"] = np.zeros_like(batch.advantages_B)
        elif kind == 6:  # huge advantages
            fields["advantages_B"] = batch.advantages_B * rng.choice([1e4, 1e30])
        elif kind == 7:  # NaN / inf advantage on a response with counted tokens
            a = fields["advantages_B"].copy()
            a[b] = rng.choice([np.nan, np.inf, -np.inf])
            fields["advantages_B"] = a
        elif kind == 8:  # a replay row that is no route: duplicate, mixed -1, out of range
            r = fields["replay_BxTxLxK"].copy()
            rb, rt = real[rng.integers(len(real))]
            layer = rng.integers(r.shape[2])
            r[rb, rt, layer] = [[1, 1], [-1, 3], [0, num_experts], [-2, 0]][rng.integers(4)]
            fields["replay_BxTxLxK"] = r
        else:            # π_θ far from π_old: stale by ±50 in log space
            fields["old_logp_BxT"] = fields["old_logp_BxT"] + rng.choice([-50.0, 50.0])
    bad = type(batch)(**fields)
    return bad, _must_skip(bad, num_experts), kinds


def _surely_skipped(kinds) -> bool:
    """A NaN / inf on a counted token (kinds 1, 2) or a counted response's advantage (7)
    that no mask (3, 4) can drop and, for 7, no later rewrite of the advantages (5, 6)
    replaces: it must be skipped whichever token or row the case drew."""
    if {3, 4} & set(kinds):
        return False
    return bool({1, 2} & set(kinds)) or (
        7 in kinds and not {5, 6} & set(kinds[kinds.index(7):]))


def _surely_applied(kinds) -> bool:
    """Only finite inputs whose size the loss bounds: log-prob gaps of ±50 (0, 9; each
    token's log-ratio is clipped to ±loss.max_log_ratio, the IS weight capped at
    loss.tis_cap), masks (3, 4) and equal rewards (5). Nothing to skip, nothing to
    overflow: the update is applied."""
    return set(kinds) <= {0, 3, 4, 5, 9}


def _probability(event) -> float:
    """P(event(kinds)) for one case: 1, 2 or 3 kinds, each count equally likely, drawn
    without replacement, so every ordered draw of k kinds has probability
    1/3 · (KINDS − k)! / KINDS!."""
    return sum(event(kinds) / (3 * math.perm(KINDS, k))
               for k in (1, 2, 3) for kinds in itertools.permutations(range(KINDS), k))


def _fewest(p: float) -> int:
    """The largest m with P(Binomial(CASES, p) < m) ≤ FAILURE_PROBABILITY: a count of
    independent cases, each an event of probability p, is at least m but for that
    probability."""
    below, m = 0.0, 0
    while True:
        below += math.comb(CASES, m) * p**m * (1 - p) ** (CASES - m)  # P(count ≤ m)
        if below > FAILURE_PROBABILITY:
            return m
        m += 1


def _all_finite(tree):
    return all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(tree)
               if np.issubdtype(np.asarray(x).dtype, np.inexact))


def test_no_adversarial_batch_reaches_the_parameters():
    cfg, eng, params, batch = _setup()
    state = eng.init_state(params)
    rng = np.random.default_rng(0)
    expected_skips = skipped = applied = sure_skips = sure_applied = 0
    for _ in range(CASES):
        bad, must_skip, kinds = _mutate(batch, rng, cfg.model.num_experts)
        state, metrics = eng.update(state, bad)
        was_skipped = step_fns.skipped(metrics)
        if must_skip:
            expected_skips += 1
            assert was_skipped, f"an update with a non-finite input was applied ({kinds=})"
        if _surely_skipped(kinds):
            sure_skips += 1
            assert must_skip, kinds
        if _surely_applied(kinds):
            sure_applied += 1
            assert not was_skipped, f"a finite, bounded update was skipped ({kinds=})"
        skipped += was_skipped
        applied += not was_skipped
        assert _all_finite(state.params) and _all_finite(state.opt_state)
    assert int(state.skipped) == skipped and int(state.step) == CASES
    # Both kinds occur: each count is Binomial(CASES, p), p from the mutations' own
    # distribution (≈ 0.34 and 29/108: at least 49 and 34 of 240, each but for 1e-6).
    assert sure_skips >= _fewest(_probability(_surely_skipped)), sure_skips
    assert sure_applied >= _fewest(_probability(_surely_applied)), sure_applied
    print(f"{CASES} adversarial updates: {skipped} skipped ({expected_skips} had to be), "
          f"{applied} applied, 0 non-finite parameters or optimizer states")
