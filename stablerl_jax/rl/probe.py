"""The attribution probe (rl.attribution with rl.attribution_every): every few steps, on a seeded
sample of rows, the per-layer split of the routing part and a dump of the rows' tokens with their
parts (`attribution.jsonl`); stablerl_jax/method/attribution.py defines the parts.

Letters: B probed rows, S slots, T = S − 1 scored positions, L layers.

On those rows a probe step runs the forwards of `attribution.probe` at θ_old (live routes, the
sampler's, and per layer the sampler's at that layer only), then before each mini-batch's update
the update's own forward of its rows (`logp_rows`), whose log π_θ gives their staleness part:
each token's parts are those the step's `attr/…` monitors count.
"""
from __future__ import annotations

import functools

import numpy as np

from stablerl_jax.method import attribution
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.rl import step_fns

DUMP_DIGITS = 5  # significant digits of the floats in attribution.jsonl


def probe_rows(params, rollout, batch: step_fns.TrainBatch, age_BxS=None, *, cfg,
               mesh=None) -> dict:
    """`attribution.probe` of the rows of `rollout` (with `age_BxS`, `params` is the tuple of
    versions of rl.old_policy=behavior), plus the `batch` fields the dump reads (and the age)."""
    attn_BxS = rollout.prompt_mask_BxS | rollout.completion_mask_BxS
    weights = (rollout.route_weights_mu_BxSxLxK[:, :-1] if cfg.rl.replay_weights else None)

    def forward(p, replay, w):
        logp, entropy, aux = policy_logprobs(
            p, rollout.tokens_BxS, attn_BxS, cfg.model, replay_BxTxLxK=replay,
            replay_weights_BxTxLxK=w, temperature=cfg.sampling.temperature,
            impl=cfg.rl.logprob_impl, mesh=mesh)
        return logp, entropy, aux["routes"]

    age_BxT = None if age_BxS is None else age_BxS[:, 1:]
    versioned = lambda fn: step_fns.by_version(lambda p: fn(functools.partial(forward, p)),
                                            params, age_BxT)
    found = attribution.probe(versioned, rollout.routes_mu_BxSxLxK[:, :-1], cfg.rl.replay,
                              weights)
    found.update(tokens_BxS=batch.tokens_BxS, mask_BxT=batch.mask_BxT,
                 rollout_logp_BxT=batch.rollout_logp_BxT, advantages_B=batch.advantages_B)
    if age_BxS is not None:
        found["age_BxS"] = age_BxS
    return found


def logp_rows(params, batch: step_fns.TrainBatch, *, cfg, mesh=None):
    """log π_θ of the batch's rows as the update's forward computes it (its replay)."""
    return policy_logprobs(params, batch.tokens_BxS, batch.attn_BxS, cfg.model,
                           replay_BxTxLxK=batch.replay_BxTxLxK,
                           replay_weights_BxTxLxK=batch.replay_weights_BxTxLxK,
                           temperature=cfg.sampling.temperature, impl=cfg.rl.logprob_impl,
                           mesh=mesh)[0]


def due(rl, step: int) -> bool:
    """Whether global step `step` (0-based) runs the probe."""
    return bool(rl.attribution and rl.attribution_every
                and (step + 1) % rl.attribution_every == 0)


def count(cfg) -> int:
    """Probed rows: rl.attribution_rows, or if 0 the least multiple of the batch shards ≥ 8."""
    shards = step_fns.batch_shards(cfg)
    return cfg.rl.attribution_rows or -(-8 // shards) * shards


def rows(cfg, step: int) -> np.ndarray:
    """The probed rows of global step `step`: `count` of its responses, seeded, sorted."""
    rl = cfg.rl
    b = rl.prompts_per_step * rl.group_size
    rng = np.random.default_rng([rl.seed, step, 2])
    return np.sort(rng.choice(b, count(cfg), replace=False)).astype(np.int32)


class Probe:
    """A probe step: `Probe(...)` after scoring (θ_old), `before_update` per update, `finish`."""

    def __init__(self, engine, params, rollout, batch, step: int, age_BxS=None):
        self.engine, self.rows = engine, rows(engine.cfg, step)
        self.batch = engine.select(batch, self.rows)
        age = None if age_BxS is None else engine.select(age_BxS, self.rows)
        self.found = engine.probe(params, engine.select(rollout, self.rows), self.batch, age)
        self.theta_BxT = np.zeros(self.found["mask_BxT"].shape, np.float64)

    def before_update(self, params, rows_M) -> None:
        """log π_θ of the probed rows in mini-batch `rows_M` at the update's θ."""
        mine = np.isin(self.rows, rows_M)
        if mine.any():
            self.theta_BxT[mine] = self.engine.logp_rows(params, self.batch)[mine]

    def finish(self, step: int, tokenizer) -> tuple[list[dict], dict]:
        """`dump` of the probe: (attribution.jsonl rows, attr_layer/… metrics)."""
        return dump(step, self.rows, self.found, self.theta_BxT, tokenizer,
                    self.found.get("age_BxS"))


def _round(x) -> list:
    return [float(f"{v:.{DUMP_DIGITS}g}") for v in np.asarray(x, np.float64)]


def dump(step: int, rows_B, found: dict, logp_theta_BxT, tokenizer, age_BxS=None
         ) -> tuple[list[dict], dict]:
    """(attribution.jsonl rows, attr_layer/… metrics) of a probe (host arrays); found: its
    `probe_rows`, logp_theta_BxT: each row's log π_θ at its mini-batch's update. A row lists its
    scored tokens with text, μ, π_old, π_θ, the three parts, the counterfactual routing part,
    π_old's entropy and the layers whose experts differ between sampler and live routing."""
    mask = np.asarray(found["mask_BxT"]) > 0
    logp_mu = np.asarray(found["rollout_logp_BxT"], np.float64)
    parts = attribution.token_parts(logp_mu, found["logp_mu_routes"], found["logp_old"],
                                    logp_theta_BxT)
    parts = {k: np.asarray(v) for k, v in parts.items()}
    metrics = attribution.layer_metrics(found["layer"], found["routing_cf"], mask)
    tokens = np.asarray(found["tokens_BxS"])
    out = []
    for i, r in enumerate(np.asarray(rows_B)):
        t = np.flatnonzero(mask[i])
        ids = tokens[i, t + 1].tolist()
        row = {"step": int(step), "row": int(r),
               "advantage": float(np.asarray(found["advantages_B"])[i]),
               "ids": ids, "tokens": [tokenizer.decode_raw([j]) for j in ids],
               "logp_mu": _round(logp_mu[i, t]),
               "logp_old": _round(np.asarray(found["logp_old"])[i, t]),
               "logp_theta": _round(np.asarray(logp_theta_BxT)[i, t]),
               **{k: _round(v[i, t]) for k, v in parts.items()},
               "routing_cf": _round(np.asarray(found["routing_cf"])[i, t]),
               "entropy": _round(np.asarray(found["entropy_old"])[i, t]),
               "flipped_layers": [np.flatnonzero(f).tolist()
                                  for f in np.asarray(found["flipped"])[i, t]]}
        if age_BxS is not None:
            row["age"] = np.asarray(age_BxS)[i, t + 1].astype(int).tolist()
        out.append(row)
    return out, metrics
