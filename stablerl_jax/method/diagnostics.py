"""Every trainer monitor, and the (numerator, denominator) pair arithmetic. Letters:
B responses, T tokens, L layers, K top-k.

Monitors are (num, den) pairs so averages over mini-batches and devices stay exact: sum
both, divide at the end (`reduce_metrics`). Keys ending `_max` / `_min` hold (value, 1 if
any token counted else 0) and reduce by max / min over entries with a nonzero denominator.
Masks are 1 on tokens that count (float or bool). Inputs are log-probs of the *sampled*
tokens (y ~ μ), so expectations are over μ's samples; ρ = π/μ, x = log ρ clipped to
±max_log_ratio before any exp:
    k1 KL(μ‖π)   E_μ[log μ − log π] = E_μ[−x]                (the paper's monitor)
    k3 KL(μ‖π)   E_μ[ρ − 1 − log ρ] = E_μ[expm1(x) − x]     (unbiased, every term ≥ 0)
    ESS          mean(w)² / mean(w²) ∈ [0, 1]                (normalized effective sample size)
The score step logs `train_infer_mismatch`; each loss its clip fractions, `weight_stats`,
`eq5_factors` (Eq. 5's two factors) and `first_order_residual`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from stablerl_jax.config import LossConfig
from stablerl_jax.model.numerics import accum_dtype

# A log-ratio is clipped to ±max_log_ratio before exp; the default is the loss's
# (LossConfig.max_log_ratio), one value for the monitors and the losses.
_MAX_LOG_RATIO = LossConfig.max_log_ratio


def _m(mask_BxT):
    return jnp.asarray(mask_BxT).astype(jnp.float32)


def _log_ratio(logp_num_BxT, logp_den_BxT, m_BxT, max_log_ratio):
    """Clipped log(num/den), 0 on masked tokens (whatever padding holds there)."""
    acc = accum_dtype(jnp.result_type(logp_num_BxT, logp_den_BxT))
    x = jnp.asarray(logp_num_BxT, acc) - jnp.asarray(logp_den_BxT, acc)
    return jnp.where(m_BxT > 0, jnp.clip(x, -max_log_ratio, max_log_ratio), 0.0)


def masked_mean_pair(values_BxT, mask_BxT):
    """(Σ_t m_t v_t, Σ_t m_t); values at masked tokens are ignored, even inf or NaN."""
    m = _m(mask_BxT)
    return jnp.sum(jnp.where(m > 0, values_BxT, 0.0)), jnp.sum(m)


def masked_extreme_pair(values_BxT, mask_BxT, op):
    """(op over counted tokens, 1.0 if any counts else 0.0); value 0 (finite) if none."""
    real = _m(mask_BxT) > 0
    fill = -jnp.inf if op is jnp.max else jnp.inf
    any_real = jnp.any(real)
    v = op(jnp.where(real, values_BxT, fill))
    return jnp.where(any_real, v, 0.0), any_real.astype(jnp.float32)


def expm1_minus_x(x):
    """e^x − 1 − x (≥ 0), accurate near 0 where the direct form cancels in float32: a
    Taylor series up to x⁵ for |x| < 0.1 (relative truncation error < 3e-7), else direct."""
    small = jnp.abs(x) < 0.1
    xs = jnp.where(small, x, 0.0)
    series = xs * xs * (0.5 + xs * (1 / 6 + xs * (1 / 24 + xs / 120)))
    return jnp.where(small, series, jnp.expm1(x) - x)


def kl_k1(logp_mu_BxT, logp_pi_BxT, mask_BxT):
    """k1 KL(μ‖π) pair, E_μ[log μ − log π] (π = π_old: the paper's train–infer KL); unclipped."""
    m = _m(mask_BxT)
    acc = accum_dtype(jnp.result_type(logp_mu_BxT, logp_pi_BxT))
    d = jnp.asarray(logp_mu_BxT, acc) - jnp.asarray(logp_pi_BxT, acc)
    return masked_mean_pair(d, m)


def kl_k3(logp_mu_BxT, logp_pi_BxT, mask_BxT, max_log_ratio: float = _MAX_LOG_RATIO):
    """k3 KL(μ‖π) pair, E_μ[ρ − 1 − log ρ]; accurate near ρ ≈ 1 (≈ x²/2, `expm1_minus_x`)."""
    m = _m(mask_BxT)
    x = _log_ratio(logp_pi_BxT, logp_mu_BxT, m, max_log_ratio)
    return masked_mean_pair(expm1_minus_x(x), m)


def weight_stats(weights_BxT, altered_BxT, mask_BxT) -> dict:
    """Pairs of a loss's applied IS weights: `is/weight_mean`, `is/weight_sqmean` (for the ESS),
    `is/weight_max`, `is/weight_min`, `is/frac_truncated` (`altered` = 1: capped or dropped)."""
    m = _m(mask_BxT)
    return {
        "is/weight_mean": masked_mean_pair(weights_BxT, m),
        "is/weight_sqmean": masked_mean_pair(weights_BxT * weights_BxT, m),
        "is/weight_max": masked_extreme_pair(weights_BxT, m, jnp.max),
        "is/weight_min": masked_extreme_pair(weights_BxT, m, jnp.min),
        "is/frac_truncated": masked_mean_pair(altered_BxT, m),
    }


def clip_fractions(hi_BxT, lo_BxT, mask_BxT) -> dict:
    """Pairs `clip/frac_high`, `clip/frac_low`: counted tokens where the clip binds, by side,
    from the loss's masks (`losses.clip_sides`; PPO family: high = [Â > 0 and r > 1+ε_high],
    low = [Â < 0 and r < 1−ε_low], r = π_θ/π_old; docs/method.md §4)."""
    m = jnp.asarray(mask_BxT)
    dt = m.dtype if jnp.issubdtype(m.dtype, jnp.floating) else jnp.float32
    return {"clip/frac_high": masked_mean_pair(jnp.asarray(hi_BxT).astype(dt), m),
            "clip/frac_low": masked_mean_pair(jnp.asarray(lo_BxT).astype(dt), m)}


def eq5_factors(logp_BxT, old_logp_BxT, rollout_logp_BxT, mask_BxT,
                max_log_ratio: float = _MAX_LOG_RATIO):
    """Eq. 5 in logs: log(π_θ/μ_old) = log(π_old/μ_old) [engine] + log(π_θ/π_old) [staleness].
    Pairs of each log factor's mean and mean square (`reduce_metrics` adds `*_std`)."""
    m = _m(mask_BxT)
    engine = _log_ratio(old_logp_BxT, rollout_logp_BxT, m, max_log_ratio)
    stale = _log_ratio(logp_BxT, old_logp_BxT, m, max_log_ratio)
    return {
        "eq5/engine_log_mean": masked_mean_pair(engine, m),
        "eq5/engine_log_sqmean": masked_mean_pair(engine**2, m),
        "eq5/staleness_log_mean": masked_mean_pair(stale, m),
        "eq5/staleness_log_sqmean": masked_mean_pair(stale**2, m),
    }


def first_order_residual_B(log_rho_BxT, mask_BxT, max_log_ratio: float = _MAX_LOG_RATIO):
    """[B]: Π_t ρ_t − (1 + Σ_t (ρ_t − 1)), the first-order error of docs/method.md §2.
    Cancellation-free: with ρ_t = 1 + δ_t, P_t = Π_{s≤t} ρ_s − 1, R_t = R_{t−1} + P_{t−1} δ_t,
    so R = Σ_t expm1(Σ_{s<t} x_s) · expm1(x_t), x = log ρ: float32-accurate for tiny δ (R ≈
    Σ_{s<t} δ_s δ_t). Prefix sums clip to ±max_log_ratio (no overflow); masked tokens: x = 0."""
    m = _m(mask_BxT)
    x = _log_ratio(log_rho_BxT, jnp.zeros_like(m), m, max_log_ratio)
    prefix = jnp.cumsum(x, axis=1) - x  # Σ_{s<t} x_s
    prefix = jnp.clip(prefix, -max_log_ratio, max_log_ratio)
    return jnp.sum(jnp.expm1(prefix) * jnp.expm1(x), axis=1)


def first_order_residual(log_rho_BxT, mask_BxT, max_log_ratio: float = _MAX_LOG_RATIO):
    """Mean |first_order_residual_B| over responses with a token: (num, den)."""
    m = _m(mask_BxT)
    r_B = first_order_residual_B(log_rho_BxT, m, max_log_ratio)
    has_B = (jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    return jnp.sum(jnp.abs(r_B) * has_B), jnp.sum(has_B)


def routing_mismatch(routes_a_BxTxLxK, routes_b_BxTxLxK, mask_BxT) -> dict:
    """Per-layer mismatch of two route tensors (e.g. inference vs training): 1 − |topk_a ∩
    topk_b| / K per token (b, t) and layer l (order-free), excluding mask 0 and a -1 (no route
    recorded) in either's K slots. Returns mismatch_rate ([L] over each layer's counted tokens,
    0 if none), any_flip (share of tokens with ≥1 counted layer whose top-k set differs in
    one), and their (num, den): mismatch_pair ([L] each), any_flip_pair."""
    a = jnp.asarray(routes_a_BxTxLxK)
    b = jnp.asarray(routes_b_BxTxLxK)
    if a.shape != b.shape or a.ndim != 4:
        raise ValueError(f"routing_mismatch: route tensors must both be [B, T, L, K], got "
                         f"{a.shape} and {b.shape}")
    if tuple(mask_BxT.shape) != a.shape[:2]:
        raise ValueError(f"routing_mismatch: mask shape {tuple(mask_BxT.shape)} must be "
                         f"[B, T] = {a.shape[:2]}")
    k = a.shape[-1]
    # One slot of b at a time keeps memory at [B, T, L, K] instead of [B, T, L, K, K].
    hit_BxTxLxK = jnp.zeros(a.shape, bool)
    for j in range(k):
        hit_BxTxLxK = hit_BxTxLxK | (a == b[..., j:j + 1])
    same_BxTxL = jnp.sum(hit_BxTxLxK, axis=-1).astype(jnp.float32)
    valid_BxTxL = (jnp.all(a >= 0, -1) & jnp.all(b >= 0, -1)
                   & (jnp.asarray(mask_BxT) > 0)[..., None])
    v_BxTxL = valid_BxTxL.astype(jnp.float32)
    num_L = jnp.sum((1.0 - same_BxTxL / k) * v_BxTxL, axis=(0, 1))
    den_L = jnp.sum(v_BxTxL, axis=(0, 1))
    counted_BxT = jnp.any(valid_BxTxL, axis=-1).astype(jnp.float32)
    flipped_BxT = jnp.any(valid_BxTxL & (same_BxTxL < k), axis=-1).astype(jnp.float32)
    flip_num, flip_den = jnp.sum(flipped_BxT), jnp.sum(counted_BxT)
    return {
        "mismatch_rate": num_L / jnp.maximum(den_L, 1.0),
        "any_flip": flip_num / jnp.maximum(flip_den, 1.0),
        "mismatch_pair": (num_L, den_L),
        "any_flip_pair": (flip_num, flip_den),
    }


def sequence_log_ratio(logp_pi_BxT, logp_mu_BxT, mask_BxT, tis_cap: float) -> dict:
    """Pairs over responses (rows with a counted token) of s = Σ_t (log π − log μ), the log
    sequence IS weight, drifting with length where token KL does not (docs/method.md §2):
    seq/log_ratio E[s], seq/log_ratio_sq E[s²], seq/beyond_cap the share with s > log tis_cap."""
    m = _m(mask_BxT)
    acc = accum_dtype(jnp.result_type(logp_pi_BxT, logp_mu_BxT))
    d_BxT = jnp.asarray(logp_pi_BxT, acc) - jnp.asarray(logp_mu_BxT, acc)
    s_B = jnp.sum(jnp.where(m > 0, d_BxT, 0.0), axis=-1)
    rows_B = (jnp.sum(m, axis=-1) > 0).astype(acc)
    n = jnp.sum(rows_B)
    return {"seq/log_ratio": (jnp.sum(rows_B * s_B), n),
            "seq/log_ratio_sq": (jnp.sum(rows_B * s_B**2), n),
            "seq/beyond_cap": (jnp.sum(rows_B * (s_B > jnp.log(tis_cap))), n)}


def train_infer_mismatch(logp_mu_BxT, logp_pi_BxT, mask_BxT, routes_mu_BxTxLxK,
                         routes_pi_BxTxLxK, routed_BxT, *, per_layer: bool = False,
                         tis_cap: float = 5.0) -> dict:
    """One rollout batch's training–inference mismatch pairs (docs/method.md §6): over the
    completion tokens (`mask_BxT`) kl/train_infer_k1, kl/train_infer_k3 (KL(μ_old‖π_old), k1
    unclipped), mismatch/abs_logp_gap and _max (|log μ − log π|), seq/… (`sequence_log_ratio`);
    over tokens both engines processed (`routed_BxT`) and recorded routing/mismatch_rate,
    routing/any_flip and, with per_layer, [L] routing/mismatch_rate_per_layer."""
    m = _m(mask_BxT)
    acc = accum_dtype(jnp.result_type(logp_mu_BxT, logp_pi_BxT))
    gap_BxT = jnp.abs(jnp.asarray(logp_mu_BxT, acc) - jnp.asarray(logp_pi_BxT, acc))
    routing = routing_mismatch(routes_mu_BxTxLxK, routes_pi_BxTxLxK, routed_BxT)
    num_L, den_L = routing["mismatch_pair"]
    out = {
        "kl/train_infer_k1": kl_k1(logp_mu_BxT, logp_pi_BxT, m),
        "kl/train_infer_k3": kl_k3(logp_mu_BxT, logp_pi_BxT, m),
        "mismatch/abs_logp_gap": masked_mean_pair(gap_BxT, m),
        "mismatch/abs_logp_gap_max": masked_extreme_pair(gap_BxT, m, jnp.max),
        "routing/mismatch_rate": (jnp.sum(num_L), jnp.sum(den_L)),
        "routing/any_flip": routing["any_flip_pair"],
        **sequence_log_ratio(logp_pi_BxT, logp_mu_BxT, mask_BxT, tis_cap),
    }
    if per_layer:
        out["routing/mismatch_rate_per_layer"] = (num_L, den_L)
    return out


def expert_load_pairs(routes_BxTxLxK, routed_BxT, num_experts: int, side: str) -> dict:
    """{"moe/{side}/load": (assignments [L, E], all assignments [L, E])}: per layer, routed
    (token, k) slots per expert, exact over batches, micro-batches and devices (`reduce_metrics`
    makes shares `expert_load_stats`); -1 routes, tokens outside `routed_BxT` count nowhere."""
    use = (routes_BxTxLxK >= 0) & routed_BxT[:, :, None, None]
    layers = routes_BxTxLxK.shape[2]
    # A scatter-add of each (token, layer, k) into its layer's expert count: no
    # [tokens, L, K, E] one-hot (a pod's batch of 48-layer, 128-expert routes).
    layer_BxTxLxK = jnp.broadcast_to(jnp.arange(layers)[:, None], routes_BxTxLxK.shape)
    counts_LxE = jnp.zeros((layers, num_experts), jnp.float32).at[
        layer_BxTxLxK, jnp.where(use, routes_BxTxLxK, num_experts)].add(1.0, mode="drop")
    total_L = jnp.sum(use, axis=(0, 1, 3), dtype=jnp.float32)
    return {f"moe/{side}/load": (counts_LxE, jnp.broadcast_to(total_L[:, None],
                                                              counts_LxE.shape))}


TOP_EXPERTS = 0.1  # expert_load_stats' top share: the most-loaded tenth of the experts


def expert_load_stats(load_LxE: np.ndarray, prefix: str) -> dict:
    """Expert-use floats (a metrics row holds scalars) from each layer's load shares (rows sum
    to 1; NaN: nothing routed), the mean over layers and per layer l:
      {prefix}/max_vio[_l{l}]     E · max_e share − 1 (verl's MaxVio, 0 balanced); `_max`: worst
      {prefix}/entropy[_l{l}]     −Σ share · log share / log E (1 = uniform use)
      {prefix}/top10_share[_l{l}] share on the ⌈E / 10⌉ most loaded experts (0.1 = uniform)"""
    load = np.asarray(load_LxE, np.float64)
    e = load.shape[1]
    with np.errstate(invalid="ignore", divide="ignore"):
        vio = e * load.max(axis=1) - 1.0
        ent = -np.sum(np.where(load > 0, load * np.log(np.where(load > 0, load, 1.0)), 0.0),
                      axis=1) / np.log(e) if e > 1 else np.zeros(load.shape[0])
        ent = np.where(np.isnan(load).any(axis=1), np.nan, ent)
    top = np.sort(load, axis=1)[:, ::-1][:, :int(np.ceil(TOP_EXPERTS * e))].sum(axis=1)
    out = {}
    for name, per_layer in (("max_vio", vio), ("entropy", ent), ("top10_share", top)):
        out[f"{prefix}/{name}"] = float(np.mean(per_layer))
        out.update({f"{prefix}/{name}_l{i}": float(v) for i, v in enumerate(per_layer)})
    out[f"{prefix}/max_vio_max"] = float(np.max(vio))
    return out


def combine_pairs(stacked: dict, xp=jnp) -> dict:
    """Pairs stacked over parts ([n, ...]) -> one summed pair per key; `*_max` / `*_min` take the
    extreme numerator over parts with den > 0 (0, 0 if none). `xp`: jnp if jitted, np on host."""
    out = {}
    for key, (num, den) in stacked.items():
        if key.endswith(("_max", "_min")):
            counted = den > 0
            fill = -xp.inf if key.endswith("_max") else xp.inf
            pick = xp.max if key.endswith("_max") else xp.min
            value = pick(xp.where(counted, num, fill), axis=0)
            out[key] = (xp.where(xp.any(counted, axis=0), value, 0.0), xp.max(den, axis=0))
        else:
            out[key] = (xp.sum(num, axis=0), xp.sum(den, axis=0))
    return out


def reduce_metrics(metric_dicts) -> dict:
    """Floats of several mini-batches' / devices' pairs: `combine_pairs`, then num / den (NaN if
    den is 0; `*_max` / `*_min`: the extreme, NaN if none counted; vector pairs: numpy arrays);
    adds `*_std` = sqrt(sqmean − mean²) per `*_sqmean`/`*_mean` pair, and `is/ess`."""
    metric_dicts = list(metric_dicts)
    if not metric_dicts:
        raise ValueError("reduce_metrics: got no metric dicts")
    stacked = {key: tuple(np.stack([np.asarray(d[key][i], np.float64) for d in metric_dicts])
                          for i in range(2)) for key in metric_dicts[0]}
    out = {}
    for key, (num, den) in combine_pairs(stacked, np).items():
        if key.endswith(("_max", "_min")):
            out[key] = float(num) if den > 0 else float("nan")
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            value = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
        out[key] = float(value) if value.ndim == 0 else value
    for key in list(out):
        if key.endswith("_sqmean") and key[:-len("_sqmean")] + "_mean" in out:
            base = key[:-len("_sqmean")]
            out[base + "_std"] = max(out[key] - out[base + "_mean"] ** 2, 0.0) ** 0.5
    for key in [k for k in out if k.startswith("moe/") and k.endswith("/load")]:
        out.update(expert_load_stats(out.pop(key), key[:-len("/load")]))
    if "is/weight_mean" in out and "is/weight_sqmean" in out:
        sq = out["is/weight_sqmean"]
        # Every weight 0 (all tokens dropped by a masked IS) means no effective sample.
        out["is/ess"] = out["is/weight_mean"] ** 2 / sq if sq > 0 else sq
    return out
