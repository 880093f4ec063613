"""Per-token attribution of the training–inference mismatch (`rl.attribution`,
docs/method.md §11). Letters: B rows (on a probe step, the probed ones), S slots,
T = S − 1 scored positions, L layers, K top-k.

A scored token's IS log-ratio log π_θ − log μ (y_t ~ μ) telescopes into three parts:
    precision  = log π(θ_old, routes_μ) − log μ     sampler's experts, trainer's arithmetic
    routing    = log π_old − log π(θ_old, routes_μ)  trainer's vs sampler's experts
    staleness  = log π_θ − log π_old                 Eq. 5's second factor
π_old is the score pass (rl/step_fns.py): θ_old routed per rl.replay (live under none and
r2; routes_μ under r3, so routing is 0; with rl.replay_weights routes_μ includes the
sampler's combine weights). routing_cf = log π(θ_old, live routes) − log π(θ_old, routes_μ),
logged in every mode, is the routing part without replay and the mismatch replay removed
under r3. With partial rollouts (rl.max_staleness) the version lag is in staleness under
rl.old_policy=behavior (π_old and both extra terms at each token's drawing version), in
precision under old_policy=proximal (π_old: the current parameters).

The score step runs one extra forward for the term its pass lacks (`TrainBatch.attr_logp_BxT`:
log π(θ_old, routes_μ) without r3, log π(θ_old, live) under r3); each mini-batch update forms
its tokens' parts with its own log π_θ (`pairs`); `derive` turns moments into variances,
covariances and shares. Every `rl.attribution_every` steps `probe` splits a few rows'
routing_cf by layer: s_l = log π(live routes) − log π(live routes, the sampler's at layer l),
layer l's flips alone. Layers need not add up (a flip changes what later layers route on;
log π is not additive), so `interaction` = routing_cf − Σ_l s_l is logged; the shares
E[s_l · routing_cf] / E[routing_cf²] and the interaction's add to 1.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.method import diagnostics as dg

PARTS = ("precision", "routing", "staleness")
# Token bins: (family, values' edges, labels). mu: the sampler's probability of the
# sampled token; entropy: the trainer's (π_θ, nats) at the token; pos: which third of
# its response the token is in.
BINS = (("mu", (0.1, 0.5), ("lt0.1", "0.1-0.5", "gt0.5")),
        ("entropy", (0.1, 1.0), ("lt0.1", "0.1-1", "gt1")),
        ("pos", None, ("first", "middle", "last")))


def score_terms(replay: str, logp_old_BxT, attr_logp_BxT):
    """(log π(θ_old, routes_μ), routing_cf) from log π_old and the extra forward's log-probs."""
    if replay == "r3":
        return logp_old_BxT, attr_logp_BxT - logp_old_BxT
    return attr_logp_BxT, logp_old_BxT - attr_logp_BxT


def token_parts(logp_mu_BxT, logp_mu_routes_BxT, logp_old_BxT, logp_BxT) -> dict:
    """The three parts per token (float32 or wider), summing to log π_θ − log μ."""
    acc = jnp.promote_types(jnp.result_type(logp_mu_BxT, logp_old_BxT, logp_BxT), jnp.float32)
    mu, mid, old, new = (jnp.asarray(x, acc) for x in (logp_mu_BxT, logp_mu_routes_BxT,
                                                        logp_old_BxT, logp_BxT))
    return {"precision": mid - mu, "routing": old - mid, "staleness": new - old}


def bins(logp_mu_BxT, entropy_BxT, mask_BxT) -> dict:
    """{family: [B, T] int32 bin 0, 1, 2} (BINS); pos: ⌊3 · index / count⌋ over scored tokens."""
    m = jnp.asarray(mask_BxT) > 0
    out = {}
    for family, edges, _ in BINS:
        if family == "mu":
            out[family] = jnp.digitize(jnp.exp(logp_mu_BxT), jnp.asarray(edges))
        elif family == "entropy":
            out[family] = jnp.digitize(entropy_BxT, jnp.asarray(edges))
        else:
            index = jnp.cumsum(m, axis=1) - 1
            count = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1)
            out[family] = jnp.minimum(3 * index // count, 2)
    return {k: v.astype(jnp.int32) for k, v in out.items()}


def _moments(prefix: str, values: dict, m_BxT) -> dict:
    out = {}
    for name, v in values.items():
        out[f"{prefix}{name}_mean"] = dg.masked_mean_pair(v, m_BxT)
        out[f"{prefix}{name}_sqmean"] = dg.masked_mean_pair(v * v, m_BxT)
    return out


def pairs(parts: dict, routing_cf_BxT, logp_mu_BxT, entropy_BxT, mask_BxT) -> dict:
    """The step's attribution monitors, (num, den) pairs over the scored tokens:
      attr/{part}_mean, _sqmean, _k3   per part, `total` (their sum) and `routing_cf`; k3 =
                                       E[e^x − 1 − x], x clipped (diagnostics._log_ratio)
      attr/{a}_x_{b}                   E[a·b] of two parts (for the covariance, `derive`)
      attr_bin/{family}_{label}/…      token share, parts' mean and sqmean per bin (BINS)
    """
    m = (jnp.asarray(mask_BxT) > 0).astype(jnp.float32)
    values = dict(parts, total=sum(parts.values()), routing_cf=routing_cf_BxT)
    out = _moments("attr/", values, m)
    for name, v in values.items():
        x = jnp.clip(v, -dg._MAX_LOG_RATIO, dg._MAX_LOG_RATIO)
        out[f"attr/{name}_k3"] = dg.masked_mean_pair(dg.expm1_minus_x(x), m)
    for a, b in itertools.combinations(PARTS, 2):
        out[f"attr/{a}_x_{b}"] = dg.masked_mean_pair(parts[a] * parts[b], m)
    binned = dict(parts, total=values["total"])
    for (family, _, labels), index in zip(BINS, bins(logp_mu_BxT, entropy_BxT, m).values()):
        for i, label in enumerate(labels):
            mb = m * (index == i)
            prefix = f"attr_bin/{family}_{label}/"
            out[prefix + "share"] = (jnp.sum(mb), jnp.sum(m))
            out.update(_moments(prefix, binned, mb))
    return out


def derive(metrics: dict) -> dict:
    """attr/{part}_var, attr/{a}_cov_{b}, attr/{part}_share = Cov(part, total) / Var(total)
    (shares add up to 1; negative: cancels another part) from reduced metrics; {} if none."""
    if "attr/total_mean" not in metrics:
        return {}
    mean = {p: metrics[f"attr/{p}_mean"] for p in PARTS + ("total",)}
    var = {p: metrics[f"attr/{p}_sqmean"] - mean[p] ** 2 for p in mean}
    cov = {}
    for a, b in itertools.combinations(PARTS, 2):
        cov[a, b] = cov[b, a] = metrics[f"attr/{a}_x_{b}"] - mean[a] * mean[b]
    out = {f"attr/{p}_var": v for p, v in var.items()}
    out.update({f"attr/{a}_cov_{b}": cov[a, b] for a, b in itertools.combinations(PARTS, 2)})
    total_var = sum(var[p] for p in PARTS) + 2 * sum(
        cov[a, b] for a, b in itertools.combinations(PARTS, 2))
    for p in PARTS:
        explained = var[p] + sum(cov[p, q] for q in PARTS if q != p)
        out[f"attr/{p}_share"] = explained / total_var if total_var > 0 else float("nan")
    return out


def flipped_layers(routes_a_BxTxLxK, routes_b_BxTxLxK):
    """[B, T, L] bool: the layer's top-k sets differ (-1 entries, nothing recorded: no flip)."""
    a, b = jnp.asarray(routes_a_BxTxLxK), jnp.asarray(routes_b_BxTxLxK)
    hit = jnp.zeros(a.shape, bool)
    for j in range(a.shape[-1]):
        hit = hit | (a == b[..., j:j + 1])
    recorded = jnp.all(a >= 0, -1) & jnp.all(b >= 0, -1)
    return recorded & ~jnp.all(hit, -1)


def probe(versioned, routes_mu_BxTxLxK, replay: str, replay_weights_BxTxLxK=None) -> dict:
    """Per-token terms of the B probed rows at θ_old. versioned(fn) calls fn(forward),
    forward(replay, weights) -> (logp, entropy, routes) of the rows at one parameter version,
    once per version (one without partial rollouts), merging each token's entries from its
    version. Returns [B, T] logp_mu_routes (log π(θ_old, routes_μ)), logp_old (score pass's),
    routing_cf, entropy_old; [B, T, L] bool flipped (live vs μ's routes); [L, B, T] layer s_l."""
    live = versioned(lambda fwd: fwd(None, None))
    logp_live, entropy_live, routes_live = live
    mu_routes = versioned(lambda fwd: fwd(routes_mu_BxTxLxK, replay_weights_BxTxLxK))
    logp_mu_routes = mu_routes[0]
    if replay == "r3":
        logp_old, entropy_old = mu_routes[0], mu_routes[1]
    else:
        logp_old, entropy_old = logp_live, entropy_live
    num_layers = routes_mu_BxTxLxK.shape[2]
    layer_L = []
    for l in range(num_layers):
        at_l = (jnp.arange(num_layers) == l)[None, None, :, None]
        # Slots nothing routed (-1 in either) route live.
        mixed = jnp.where(at_l & (routes_mu_BxTxLxK >= 0), routes_mu_BxTxLxK, routes_live)
        layer_L.append(logp_live - versioned(lambda fwd, r=mixed: fwd(r, None))[0])
    return {"logp_mu_routes": logp_mu_routes, "logp_old": logp_old,
            "routing_cf": logp_live - logp_mu_routes, "entropy_old": entropy_old,
            "flipped": flipped_layers(routes_mu_BxTxLxK, routes_live),
            "layer": jnp.stack(layer_L)}


def layer_metrics(layer_LxBxT, routing_cf_BxT, mask_BxT) -> dict:
    """Host floats over the probe's scored tokens: attr_layer/l{l}_mean E[s_l] and
    attr_layer/l{l}_share E[s_l · routing_cf] / E[routing_cf²], the same two for
    `interaction`, and attr_layer/routing_cf_mean, _sqmean."""
    m = np.asarray(mask_BxT) > 0
    layer = np.asarray(layer_LxBxT, np.float64)[:, m]
    cf = np.asarray(routing_cf_BxT, np.float64)[m]
    if not m.any():
        return {}
    sq = float(np.mean(cf * cf))
    share = lambda s: float(np.mean(s * cf) / sq) if sq > 0 else float("nan")
    out = {"attr_layer/routing_cf_mean": float(np.mean(cf)), "attr_layer/routing_cf_sqmean": sq}
    for l, s in enumerate(layer):
        out[f"attr_layer/l{l}_mean"] = float(np.mean(s))
        out[f"attr_layer/l{l}_share"] = share(s)
    rest = cf - layer.sum(0)
    out["attr_layer/interaction_mean"] = float(np.mean(rest))
    out["attr_layer/interaction_share"] = share(rest)
    return out
