"""First-order surrogate losses (PAPER.md §2, §4). Each returns the quantity to MINIMIZE.

Letters: B responses in the batch, T token positions.

Signature of every loss: `loss_fn(logp_BxT, batch, cfg) -> (loss, metrics)`, where
batch holds `old_logp_BxT` (log π_old, training engine), `rollout_logp_BxT` (log μ_old,
sampling engine), `advantages_B` (or `advantages_BxT`) and `mask_BxT` (1 on response
tokens that count). `metrics` maps names to (numerator, denominator) pairs so that
averages over mini-batches and devices stay exact (`reduce_metrics`).

Ratios (all log-ratios are clipped to ±max_log_ratio before exp):
    ρ_t = π_θ/μ_old     (full token IS ratio, Eq. 3)
    r_t = π_θ/π_old     (staleness, clipped in PPO-style losses)
    π_old/μ_old         (training–inference discrepancy, Eq. 5 first factor)

Aggregations of a per-token term ℓ_bt over the mask m:
    response_sum             Σ_b Σ_t m ℓ / B                (MiniRL: no 1/|y|)
    seq_mean_token_mean      Σ_b (Σ_t m ℓ / |y_b|) / B      (GRPO; MiniRL + length norm)
    token_mean               Σ m ℓ / Σ m                    (CISPO, DAPO)
    seq_mean_token_sum_norm  Σ m ℓ / (B · T)                (Dr. GRPO: a constant)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stablerl_jax.config import LossConfig

sg = jax.lax.stop_gradient


def _parts(logp_BxT, batch, cfg: LossConfig):
    m = batch["mask_BxT"].astype(jnp.float32)
    adv = batch.get("advantages_BxT")
    if adv is None:
        adv = jnp.broadcast_to(batch["advantages_B"][:, None], m.shape)
    lim = cfg.max_log_ratio
    clip = lambda x: jnp.clip(x, -lim, lim) * m  # masked positions contribute log-ratio 0
    log_r = clip(logp_BxT - batch["old_logp_BxT"])              # staleness (has gradient)
    log_engine = clip(batch["old_logp_BxT"] - batch["rollout_logp_BxT"])
    log_rho = clip(logp_BxT - batch["rollout_logp_BxT"])        # full ratio (has gradient)
    return m, adv.astype(jnp.float32), log_r, log_engine, log_rho


def aggregate(term_BxT, m_BxT, mode: str):
    """Reduce a per-token term to a scalar objective (see module docstring)."""
    b, t = m_BxT.shape
    s = jnp.sum(term_BxT * m_BxT, axis=1)
    if mode == "response_sum":
        return jnp.sum(s) / b
    if mode == "seq_mean_token_mean":
        return jnp.sum(s / jnp.maximum(jnp.sum(m_BxT, axis=1), 1.0)) / b
    if mode == "token_mean":
        return jnp.sum(s) / jnp.maximum(jnp.sum(m_BxT), 1.0)
    if mode == "seq_mean_token_sum_norm":
        return jnp.sum(s) / (b * t)
    raise ValueError(f"aggregation: unknown mode {mode!r}")


def is_weight(log_ratio_BxT, m_BxT, cfg: LossConfig):
    """Stop-gradient IS weight of a (clipped, masked) log-ratio under cfg.is_correction.

    tis:          min(ρ, C)
    mis:          ρ · [ρ ≤ is_high]              (token masked IS, upper side)
    icepop:       ρ · [is_low ≤ ρ ≤ is_high]     (two-sided masking)
    seq_product:  min(exp(Σ_t log ρ_t), C) on every token of the response
    seq_geomean:  min(exp(mean_t log ρ_t), C)  on every token of the response
    none:         1
    """
    x = sg(log_ratio_BxT)
    mode = cfg.is_correction
    if mode == "none":
        return jnp.ones_like(x)
    rho = jnp.exp(x)
    if mode == "tis":
        return jnp.minimum(rho, cfg.tis_cap)
    if mode == "mis":
        return jnp.where(rho <= cfg.is_high, rho, 0.0)
    if mode == "icepop":
        return jnp.where((rho >= cfg.is_low) & (rho <= cfg.is_high), rho, 0.0)
    s = jnp.sum(x * m_BxT, axis=1, keepdims=True)
    if mode == "seq_geomean":
        s = s / jnp.maximum(jnp.sum(m_BxT, axis=1, keepdims=True), 1.0)
    s = jnp.clip(s, -cfg.max_log_ratio, jnp.log(cfg.tis_cap))
    return jnp.broadcast_to(jnp.exp(s), x.shape)


def _common_metrics(m, adv, log_r, log_engine, weight, cfg, clipped_hi, clipped_lo,
                    log_weighted=None):
    """(num, den) monitors; `log_weighted` is the log-ratio the IS weight was formed from
    (default: the engine factor)."""
    log_weighted = log_engine if log_weighted is None else log_weighted
    n = jnp.sum(m)
    ratio = lambda x: (jnp.sum(x * m), n)
    w_real = jnp.where(m > 0, weight, jnp.nan)
    return {
        "clip/frac_high": ratio(clipped_hi.astype(jnp.float32)),
        "clip/frac_low": ratio(clipped_lo.astype(jnp.float32)),
        "is/weight_mean": ratio(weight),
        "is/weight_max": (jnp.nan_to_num(jnp.nanmax(w_real), nan=0.0), jnp.ones(())),
        "is/weight_min": (jnp.nan_to_num(jnp.nanmin(w_real), nan=0.0), jnp.ones(())),
        "is/frac_truncated": ratio((sg(log_weighted) > jnp.log(cfg.tis_cap)).astype(jnp.float32)),
        "kl/engine_k1": ratio(-log_engine),
        "eq5/engine_log_mean": ratio(log_engine),
        "eq5/engine_log_sqmean": ratio(log_engine**2),
        "eq5/staleness_log_mean": ratio(sg(log_r)),
        "eq5/staleness_log_sqmean": ratio(sg(log_r) ** 2),
    }


def _clip_masks(adv, log_r, cfg, eps_low, eps_high):
    r = jnp.exp(sg(log_r))
    hi = (adv > 0) & (r > 1 + eps_high)
    lo = (adv < 0) & (r < 1 - eps_low)
    return hi, lo


def minirl(logp_BxT, batch, cfg: LossConfig):
    """MiniRL, Eq. 7:  J = (1/B) Σ_b Σ_t M_t · sg[min(π_θ/μ_old, C)] · Â_b · log π_θ(y_t).

    M_t = 0 when Â > 0 and r_t > 1+ε_high, or Â < 0 and r_t < 1−ε_low (r = π_θ/π_old);
    the gradient flows only through log π_θ, so ∇J equals the Eq. 4 REINFORCE gradient
    with token weight π_θ/μ_old (capped) and the mask. Options: aggregation
    'seq_mean_token_mean' (+ length normalization), use_is=False (w/o train–infer IS:
    weight 1), clip=False (M ≡ 1), cap_target='engine' (weight = min(π_old/μ_old, C) ·
    π_θ/π_old), is_correction (how the weight is formed; 'tis' is Eq. 7's).
    """
    m, adv, log_r, log_engine, log_rho = _parts(logp_BxT, batch, cfg)
    if not cfg.use_is:
        w = jnp.ones_like(m)
    elif cfg.cap_target == "full":
        w = is_weight(log_rho, m, cfg)
    else:
        w = is_weight(log_engine, m, cfg) * jnp.exp(sg(log_r))
    hi, lo = _clip_masks(adv, log_r, cfg, cfg.eps_low, cfg.eps_high)
    keep = jnp.where(hi | lo, 0.0, 1.0) if cfg.clip else jnp.ones_like(m)
    term = keep * sg(w) * adv * logp_BxT
    obj = aggregate(term, m, cfg.aggregation or "response_sum")
    metrics = _common_metrics(m, adv, log_r, log_engine, w, cfg, hi & cfg.clip, lo & cfg.clip,
                              log_rho if cfg.cap_target == "full" else log_engine)
    return -obj, {**metrics, "loss": (-obj, jnp.ones(()))}


def _engine_weight(log_engine, m, cfg):
    return is_weight(log_engine, m, cfg) if cfg.use_is else jnp.ones_like(m)


def _ppo(logp_BxT, batch, cfg, default_agg):
    m, adv, log_r, log_engine, _ = _parts(logp_BxT, batch, cfg)
    r = jnp.exp(log_r)
    w = _engine_weight(log_engine, m, cfg)
    if cfg.clip:
        term = jnp.minimum(r * adv, jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * adv)
    else:
        term = r * adv
    obj = aggregate(sg(w) * term, m, cfg.aggregation or default_agg)
    hi, lo = _clip_masks(adv, log_r, cfg, cfg.eps_low, cfg.eps_high)
    metrics = _common_metrics(m, adv, log_r, log_engine, w, cfg, hi & cfg.clip, lo & cfg.clip)
    return -obj, {**metrics, "loss": (-obj, jnp.ones(()))}


def grpo(logp_BxT, batch, cfg: LossConfig):
    """GRPO (App. A): (1/G) Σ_i (1/|y_i|) Σ_t min(r Â, clip(r, 1−ε_low, 1+ε_high) Â).

    Use with advantage='group_norm' for GRPO's (R − mean)/std. The paper's GRPO has no
    π_old/μ_old factor; set use_is=False for that exact form. With use_is (default) each
    token is multiplied by sg[w(π_old/μ_old)] from is_correction (the decoupled TIS
    correction).
    """
    return _ppo(logp_BxT, batch, cfg, "seq_mean_token_mean")


def dapo(logp_BxT, batch, cfg: LossConfig):
    """DAPO: the PPO-clip term with clip-higher (ε_high > ε_low; DAPO uses 0.28) and
    token-mean aggregation (1/Σ|y_i|) Σ_i Σ_t. Dynamic sampling is not part of the loss."""
    return _ppo(logp_BxT, batch, cfg, "token_mean")


def cispo(logp_BxT, batch, cfg: LossConfig):
    """CISPO (App. A): (1/Σ|y_i|) Σ_i Σ_t sg[clip(r, 1−ε_low, 1+ε_high)] Â log π_θ.

    Every token keeps its gradient (the ratio is clipped, never the token); optionally
    times sg[w(π_old/μ_old)]. CISPO's paper clips only from above; ε_low = 1 recovers it.
    """
    m, adv, log_r, log_engine, _ = _parts(logp_BxT, batch, cfg)
    r = jnp.exp(sg(log_r))
    rc = jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) if cfg.clip else r
    w = _engine_weight(log_engine, m, cfg)
    obj = aggregate(sg(w * rc) * adv * logp_BxT, m, cfg.aggregation or "token_mean")
    hi = (r > 1 + cfg.eps_high) & cfg.clip
    lo = (r < 1 - cfg.eps_low) & cfg.clip
    metrics = _common_metrics(m, adv, log_r, log_engine, w, cfg, hi, lo)
    return -obj, {**metrics, "loss": (-obj, jnp.ones(()))}


def _gspo(logp_BxT, batch, cfg, token_level: bool):
    m, adv, log_r, log_engine, _ = _parts(logp_BxT, batch, cfg)
    length = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)
    log_s = jnp.sum(log_r, axis=1, keepdims=True) / length        # (1/|y|) Σ log r
    if token_level:  # s_it = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]: same value, per-token grad
        log_s = sg(log_s) + logp_BxT - sg(logp_BxT)
    s = jnp.exp(jnp.broadcast_to(log_s, m.shape))
    lo_b, hi_b = 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high
    term = jnp.minimum(s * adv, jnp.clip(s, lo_b, hi_b) * adv) if cfg.clip else s * adv
    w = _engine_weight(log_engine, m, cfg)
    if cfg.use_is and cfg.is_correction not in ("seq_product", "seq_geomean"):
        # GSPO is sequence-level: use the geometric-mean engine weight of the response.
        w = is_weight(log_engine, m, cfg.replace(is_correction="seq_geomean"))
    obj = aggregate(sg(w) * term, m, cfg.aggregation or "seq_mean_token_mean")
    sv = jnp.exp(sg(log_s))
    hi = (adv > 0) & (sv > hi_b) & cfg.clip
    lo = (adv < 0) & (sv < lo_b) & cfg.clip
    metrics = _common_metrics(m, adv, log_r, log_engine, w, cfg, hi, lo)
    return -obj, {**metrics, "loss": (-obj, jnp.ones(()))}


def gspo(logp_BxT, batch, cfg: LossConfig):
    """GSPO: s_i = exp((1/|y_i|) Σ_t log r_t); J = (1/G) Σ_i min(s_i Â_i, clip(s_i) Â_i),
    with the tiny range [1 − gspo_eps_low, 1 + gspo_eps_high]. Written as a per-token term
    with seq_mean_token_mean so every token carries its response's value; the engine
    factor, if used, is the geometric-mean sequence weight."""
    return _gspo(logp_BxT, batch, cfg, token_level=False)


def gspo_token(logp_BxT, batch, cfg: LossConfig):
    """GSPO-token: s_it = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)]; equals GSPO in value and, for
    per-response advantages, in gradient; allows per-token advantages."""
    return _gspo(logp_BxT, batch, cfg, token_level=True)


LOSSES = {
    "minirl": minirl,
    "grpo": grpo,
    "cispo": cispo,
    "gspo": gspo,
    "gspo_token": gspo_token,
    "dapo": dapo,
}


def reduce_metrics(metric_dicts) -> dict:
    """Combine (num, den) metrics of several mini-batches / devices into floats.

    Sums numerators and denominators, then divides. Keys ending in `_max` / `_min` take the
    max / min of numerators. `*_sqmean` keys also yield the matching `*_std`.
    """
    out = {}
    for key in metric_dicts[0]:
        nums = [float(d[key][0]) for d in metric_dicts]
        dens = [float(d[key][1]) for d in metric_dicts]
        if key.endswith("_max"):
            out[key] = max(nums)
        elif key.endswith("_min"):
            out[key] = min(nums)
        else:
            out[key] = sum(nums) / sum(dens) if sum(dens) > 0 else 0.0
    for key in list(out):
        if key.endswith("_sqmean"):
            mean = out.get(key.replace("_sqmean", "_mean"), 0.0)
            out[key.replace("_sqmean", "_std")] = max(out[key] - mean**2, 0.0) ** 0.5
    return out
