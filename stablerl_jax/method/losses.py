"""First-order surrogate losses (docs/method.md §2, §4), each returning the value to MINIMIZE:
`loss_fn(logp_BxT, batch: LossBatch, cfg) -> (loss, metrics)`, cfg a `LossConfig`. Letters:
B responses in the (mini-)batch, T token positions.

logp_BxT is log π_θ of the sampled tokens (differentiable), batch.old_logp_BxT log π_old
(training engine, θ_old), batch.rollout_logp_BxT log μ_old (sampling engine), batch.mask_BxT
1 on counted completion tokens (float or bool); Â is per response (batch.advantages_B) or per
token (batch.advantages_BxT, preferred when both are given). A token log-ratio is clipped to
±max_log_ratio before exp, a sequence one after its sum (GSPO's mean log-ratio at
≤ gspo_max_log_ratio, as tunix and verl do):
    ρ_t = π_θ/μ_old   full token IS ratio (Eq. 3)  = (π_old/μ_old) · (π_θ/π_old)  (Eq. 5)
    r_t = π_θ/π_old   staleness ratio, the one PPO-style clipping looks at
    e_t = π_old/μ_old training–inference (engine) factor

Aggregations of a per-token term ℓ_bt over the mask m, |y_b| = Σ_t m_bt (cfg.aggregation
None: the loss's row in `loss_table.LOSS_TABLE`):
    response_sum             (1/B') Σ_b Σ_t m ℓ         (MiniRL: no 1/|y|)
    seq_mean_token_mean      (1/B') Σ_b (1/|y_b|) Σ_t m ℓ  (GRPO, GSPO; MiniRL + length norm)
    token_mean               Σ m ℓ / Σ m                 (CISPO, DAPO)
    seq_mean_token_sum_norm  Σ m ℓ / (B' · T_norm)       (Dr. GRPO; T_norm = cfg.norm_length,
                                                          or the padded T when it is 0)
B' per cfg.row_denominator: 'scored' (default) counts responses with a scored token, so an
empty row (e.g. masked under rl.overlong=mask) contributes 0 and counts in no denominator;
'all' counts every row (B' = B, as verl's `global_batch_size` and tunix divide; 'scored' =
'all' · B/(B − e), e empty rows). A fully masked batch gives loss 0; a non-finite log π_old,
log μ_old or Â on a counted token gives NaN, so the trainer skips the update rather than let
NaN comparisons slip past the clipping mask. Micro-batching (rl/accumulate.py): a slice
divides by `batch.totals` (the mini-batch's B, Σ m, non-empty rows), so the slices' losses
and gradients add up to the mini-batch's exactly; the `loss` metric (slice loss, slice rows
/ B) sums to (mini-batch loss, 1).

`metrics` are (num, den) pairs (`_finish`, via `diagnostics`; `diagnostics.reduce_metrics`
adds *_std, is/ess): loss, clip/*, is/*, eq5/* and, with loss.trust_region on,
trust_region/frac_masked (scored responses `trust_region_keep` removed). The
training–inference KL is the score step's (`diagnostics.train_infer_mismatch`): π_old is
fixed over a step's updates. `LOSS_PRESETS`: the paper's runs and namesake methods.
"""
from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp

from stablerl_jax import input_checks
from stablerl_jax.config import IS_CORRECTIONS, LossConfig
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.config.loss_table import LOSS_TABLE
from stablerl_jax.model.numerics import accum_dtype

sg = jax.lax.stop_gradient


class Totals(typing.NamedTuple):
    """The whole mini-batch's sizes, for a loss that sees one micro-batch of it."""

    rows: jax.Array       # B of the mini-batch
    tokens: jax.Array     # Σ mask over the mini-batch
    responses: jax.Array  # its non-empty rows (B' of row_denominator='scored')


def mask_totals(mask_BxT) -> Totals:
    """The `Totals` of a (mini-)batch from its mask."""
    m = jnp.asarray(mask_BxT).astype(jnp.float32)
    return Totals(jnp.asarray(m.shape[0], jnp.float32), jnp.sum(m),
                  jnp.sum(jnp.sum(m, axis=1) > 0).astype(jnp.float32))


class LossBatch(typing.NamedTuple):
    """What a loss reads of a (mini-)batch (module docstring)."""

    old_logp_BxT: jax.Array
    rollout_logp_BxT: jax.Array
    mask_BxT: jax.Array
    advantages_B: jax.Array | None = None
    advantages_BxT: jax.Array | None = None
    totals: Totals | None = None  # the mini-batch's, when this is a micro-batch of it
    rows: jax.Array | None = None  # this micro-batch's rows when the batch is the whole
                                   # mini-batch with the other rows' mask zeroed (packing)


class _Parts(typing.NamedTuple):
    m: jax.Array           # float mask
    adv: jax.Array         # Â per token
    logp: jax.Array        # log π_θ, 0 on masked tokens (gradient only where m = 1)
    log_r: jax.Array       # log π_θ/π_old (has gradient; unclipped: `_clip` before exp)
    log_engine: jax.Array  # log π_old/μ_old (constant, unclipped)
    log_rho: jax.Array     # log π_θ/μ_old (has gradient, unclipped)
    finite: jax.Array      # every counted token's π_old, μ_old and Â are finite
    tr_masked_B: jax.Array  # 1 on the scored responses trust-region masking removed


def _parts(logp_BxT, batch: LossBatch, cfg: LossConfig) -> _Parts:
    shape = jnp.shape(logp_BxT)
    input_checks.nonempty(shape, "logp_BxT")
    for name in ("old_logp_BxT", "rollout_logp_BxT", "mask_BxT"):
        if jnp.shape(getattr(batch, name)) != shape:
            raise ValueError(f"batch.{name}: shape {jnp.shape(getattr(batch, name))} must "
                             f"equal logp_BxT's {shape}")
    for name in ("old_logp_BxT", "rollout_logp_BxT"):
        if not jnp.issubdtype(jnp.result_type(getattr(batch, name)), jnp.floating):
            raise ValueError(f"batch.{name}: dtype {jnp.result_type(getattr(batch, name))} "
                             "must be floating (log-probabilities)")
    # The mask's values (0 / 1) only under input_checks.checking(): no sync per step.
    input_checks.mask(batch.mask_BxT, shape, name="batch.mask_BxT")
    # float32 arithmetic, or float64 for float64 log-probs (reference runs under x64).
    acc = accum_dtype(jnp.result_type(logp_BxT))
    if batch.advantages_BxT is not None:
        adv = jnp.asarray(batch.advantages_BxT, acc)
        if adv.shape != shape:
            raise ValueError(f"batch.advantages_BxT: shape {adv.shape} must be {shape}")
    elif batch.advantages_B is not None:
        adv = jnp.asarray(batch.advantages_B, acc)
        if adv.shape != shape[:1]:
            raise ValueError(f"batch.advantages_B: shape {adv.shape} must be {shape[:1]}")
        adv = jnp.broadcast_to(adv[:, None], shape)
    else:
        raise ValueError("batch: give advantages_B (per response) or advantages_BxT")
    m = jnp.asarray(batch.mask_BxT).astype(acc)
    real = m > 0
    # Padding may hold anything (-inf, garbage); `where` keeps it out of values and grads.
    real_only = lambda x: jnp.where(real, jnp.asarray(x).astype(acc), 0.0)
    logp = real_only(logp_BxT)
    old, mu = sg(real_only(batch.old_logp_BxT)), sg(real_only(batch.rollout_logp_BxT))
    adv = jnp.where(real, adv, 0.0)
    finite = jnp.all(jnp.isfinite(old) & jnp.isfinite(mu) & jnp.isfinite(adv))
    keep_B = trust_region_keep(old - mu, m, cfg)
    adv = jnp.where(keep_B[:, None], adv, 0.0)
    masked_B = (~keep_B & (jnp.sum(m, axis=1) > 0)).astype(acc)
    return _Parts(m, adv, logp, logp - old, old - mu, logp - mu, finite, masked_B)


def trust_region_keep(log_engine_BxT, m_BxT, cfg: LossConfig):
    """Trust-region masking, [B] bool: keep_b = max_t D_bt ≤ δ = cfg.trust_region_delta, D =
    log μ_old − log π_old ('k1') or |log π_old/μ_old| ('abs'); all rows under 'none'. A
    removed response's Â is 0 (no loss contribution); the denominators keep it."""
    if cfg.trust_region == "none":
        return jnp.ones(m_BxT.shape[:1], bool)
    x = sg(log_engine_BxT)
    div = -x if cfg.trust_region == "k1" else jnp.abs(x)
    worst_B = jnp.max(jnp.where(m_BxT > 0, div, -jnp.inf), axis=1)
    return worst_B <= cfg.trust_region_delta


def _clip(x, cfg: LossConfig):
    """Token log-ratio clipped to ±max_log_ratio, so its exp stays finite."""
    return jnp.clip(x, -cfg.max_log_ratio, cfg.max_log_ratio)


def aggregate(term_BxT, m_BxT, mode: str, norm_length: int = 0,
              totals: Totals | None = None, row_denominator: str = "scored"):
    """Per-token term -> scalar objective (module docstring); B', Σ m from `totals` if given."""
    t = m_BxT.shape[1]
    length_B = jnp.sum(m_BxT, axis=1)
    tokens, responses = jnp.sum(length_B), jnp.sum(length_B > 0).astype(m_BxT.dtype)
    if totals is not None:
        tokens, responses = (x.astype(m_BxT.dtype) for x in totals[1:])
    if row_denominator == "all":
        responses = jnp.asarray(m_BxT.shape[0] if totals is None else totals.rows,
                                m_BxT.dtype)
    elif row_denominator != "scored":
        raise ValueError(f"row_denominator: unknown {row_denominator!r}")
    s = jnp.sum(jnp.where(m_BxT > 0, term_BxT, 0.0), axis=1)
    if mode == "response_sum":
        return jnp.sum(s) / jnp.maximum(responses, 1.0)
    if mode == "seq_mean_token_mean":
        return jnp.sum(s / jnp.maximum(length_B, 1.0)) / jnp.maximum(responses, 1.0)
    if mode == "token_mean":
        return jnp.sum(s) / jnp.maximum(tokens, 1.0)
    if mode == "seq_mean_token_sum_norm":
        return jnp.sum(s) / (jnp.maximum(responses, 1.0) * (norm_length or t))
    raise ValueError(f"aggregation: unknown mode {mode!r}")


def _objective(term_BxT, p: _Parts, batch: LossBatch, cfg: LossConfig, name: str):
    """J: the term aggregated by cfg.aggregation, or loss `name`'s own (its row)."""
    return aggregate(term_BxT, p.m, cfg.aggregation or LOSS_TABLE[name].aggregation,
                     cfg.norm_length, batch.totals, cfg.row_denominator)


def row_share(batch_rows: int, totals: Totals | None):
    """Batch rows / mini-batch rows (1 without totals): the slices' (v, share) sum to (v, 1)."""
    if totals is None:
        return jnp.ones(())
    return batch_rows / totals.rows


def is_weight(log_ratio_BxT, m_BxT, cfg: LossConfig):
    """Stop-gradient (weight_BxT, altered_BxT) from a masked log-ratio x = log ρ under
    cfg.is_correction (`altered`: 1 where truncated or dropped):
    none:         1
    tis:          min(ρ, C)                                   (token truncated IS)
    mis:          ρ · [ρ ≤ is_high]                           (token masked IS, upper side)
    icepop:       ρ · [is_low ≤ ρ ≤ is_high]                  (two-sided masking)
    seq_product:  min(exp(Σ_t x_t), C) on every token         (sequence IS, log space)
    seq_geomean:  min(exp((1/|y|) Σ_t x_t), C) on every token (geometric mean)
    Token modes clip each x_t to ±max_log_ratio; sequence modes clip the sum to [−max_log_ratio,
    log C], as verl does: one extreme token moves the weight by its whole log-ratio."""
    mode = cfg.is_correction
    log_cap = math.log(cfg.tis_cap)
    if mode == "none":
        return jnp.ones_like(log_ratio_BxT), jnp.zeros_like(log_ratio_BxT)
    x = sg(log_ratio_BxT)
    if not mode.startswith("seq_"):
        x = _clip(x, cfg)
    if mode == "tis":
        return jnp.exp(jnp.minimum(x, log_cap)), (x > log_cap).astype(x.dtype)
    if mode in ("mis", "icepop"):
        lo = math.log(cfg.is_low) if (mode == "icepop" and cfg.is_low > 0) else -jnp.inf
        keep = (x <= math.log(cfg.is_high)) & (x >= lo)
        return jnp.where(keep, jnp.exp(x), 0.0), (~keep).astype(x.dtype)
    if mode in ("seq_product", "seq_geomean"):
        s = jnp.sum(jnp.where(m_BxT > 0, x, 0.0), axis=1, keepdims=True)
        if mode == "seq_geomean":
            s = s / jnp.maximum(jnp.sum(m_BxT, axis=1, keepdims=True), 1.0)
        altered = jnp.broadcast_to((s > log_cap).astype(x.dtype), x.shape)
        s = jnp.clip(s, -cfg.max_log_ratio, log_cap)
        return jnp.broadcast_to(jnp.exp(s), x.shape), altered
    raise ValueError(f"loss.is_correction: unknown {mode!r}; choose one of {IS_CORRECTIONS}")


def _engine_weight(p: _Parts, cfg: LossConfig):
    """sg[w(π_old/μ_old)] for the PPO-family losses; 1 with use_is off."""
    if not cfg.use_is:
        return jnp.ones_like(p.m), jnp.zeros_like(p.m)
    return is_weight(p.log_engine, p.m, cfg)


def clip_sides(adv, log_ratio, lo_bound, hi_bound, enabled: bool):
    """Tokens where the PPO clip binds: Â > 0 with ratio > hi, Â < 0 with ratio < lo."""
    x = sg(log_ratio)
    hi = (adv > 0) & (x > math.log(hi_bound)) & enabled
    lo = (adv < 0) & (x < math.log(lo_bound)) & enabled
    return hi, lo


def _finish(p: _Parts, batch: LossBatch, cfg: LossConfig, loss, weight, altered, hi, lo):
    """(loss, metrics): loss NaN if a counted token's input is non-finite; every loss's pairs."""
    loss = jnp.where(p.finite, loss, jnp.nan)
    share = jnp.asarray(row_share(p.m.shape[0] if batch.rows is None else batch.rows,
                                  batch.totals)).astype(p.m.dtype)
    out = {"loss": (sg(loss), share), **dg.clip_fractions(hi, lo, p.m)}
    out.update(dg.weight_stats(sg(weight), altered, p.m))
    out.update(dg.eq5_factors(sg(p.logp), batch.old_logp_BxT, batch.rollout_logp_BxT, p.m,
                              cfg.max_log_ratio))
    # |Π_t ρ_t − (1 + Σ_t (ρ_t − 1))| per response: how far from first order the batch is.
    out["eq5/first_order_residual_abs"] = dg.first_order_residual(sg(p.log_rho), p.m,
                                                                  cfg.max_log_ratio)
    if cfg.trust_region != "none":
        out["trust_region/frac_masked"] = (jnp.sum(p.tr_masked_B),
                                           jnp.sum((jnp.sum(p.m, axis=1) > 0).astype(p.m.dtype)))
    return loss, out


def minirl(logp_BxT, batch, cfg: LossConfig):
    """MiniRL, Eq. 7 (docs/method.md §4): loss = −J,
        J = (1/B) Σ_b Σ_t M_t · sg[min(π_θ/μ_old, C)] · Â_b · log π_θ(y_t),
    M_t = 0 if Â > 0 and r_t > 1+ε_high or Â < 0 and r_t < 1−ε_low (r = π_θ/π_old), else 1.
    The gradient flows only through log π_θ: ∇J is Eq. 4's REINFORCE gradient with token
    weight π_θ/μ_old (capped at C) and the mask. 1/B (the module's B') is this project's
    constant; the paper averages over responses. Ablations: aggregation='seq_mean_token_mean'
    (length norm), use_is=False (weight 1), clip=False (M ≡ 1). Beyond the paper: is_correction
    ('tis' is Eq. 7's), cap_target='engine' (weight min(π_old/μ_old, C) · π_θ/π_old)."""
    p = _parts(logp_BxT, batch, cfg)
    if not cfg.use_is:
        w, altered = jnp.ones_like(p.m), jnp.zeros_like(p.m)
    elif cfg.cap_target == "full":
        w, altered = is_weight(p.log_rho, p.m, cfg)
    else:
        w, altered = is_weight(p.log_engine, p.m, cfg)
        w = w * jnp.exp(sg(_clip(p.log_r, cfg)))
    hi, lo = clip_sides(p.adv, p.log_r, 1 - cfg.eps_low, 1 + cfg.eps_high, cfg.clip)
    keep = jnp.where(hi | lo, 0.0, 1.0)
    term = keep * sg(w) * p.adv * p.logp
    loss = -_objective(term, p, batch, cfg, "minirl")
    return _finish(p, batch, cfg, loss, w, altered, hi, lo)


def _ppo(logp_BxT, batch, cfg: LossConfig, name: str):
    p = _parts(logp_BxT, batch, cfg)
    r = jnp.exp(_clip(p.log_r, cfg))
    w, altered = _engine_weight(p, cfg)
    if cfg.clip:
        term = jnp.minimum(r * p.adv, jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * p.adv)
    else:
        term = r * p.adv
    # verl's dual-clip: with Â < 0 the term is at least c·Â, a constant for r > c.
    dual = (p.adv < 0) & (r > cfg.clip_ratio_c) & (cfg.clip_ratio_c > 0)
    term = jnp.where(dual, cfg.clip_ratio_c * p.adv, term)
    loss = -_objective(sg(w) * term, p, batch, cfg, name)
    hi, lo = clip_sides(p.adv, p.log_r, 1 - cfg.eps_low, 1 + cfg.eps_high, cfg.clip)
    loss, metrics = _finish(p, batch, cfg, loss, w, altered, hi, lo)
    if cfg.clip_ratio_c > 0:
        metrics["clip/frac_dual"] = dg.masked_mean_pair(dual.astype(p.m.dtype), p.m)
    return loss, metrics


def grpo(logp_BxT, batch, cfg: LossConfig):
    """GRPO (the paper's App. A form, docs/method.md §5): loss = −J,
        J = (1/B) Σ_i (1/|y_i|) Σ_t sg[w_t] · min(r_t Â_i, clip(r_t, 1−ε_low, 1+ε_high) Â_i).
    Pair with advantage='group_norm' (Â = (R − mean)/std). App. A has no engine factor
    (use_is=False, w ≡ 1) and no KL penalty (nor does this code); use_is=True (LossConfig's
    default): w = is_weight(π_old/μ_old), e.g. decoupled token TIS sg[min(π_old/μ_old, C)].
    With clip_ratio_c = c > 0 (verl's dual-clip) a token with Â < 0 gives
    max(min(r Â, clip(r) Â), c Â): the constant c Â, without gradient, where r > c."""
    return _ppo(logp_BxT, batch, cfg, "grpo")


def dapo(logp_BxT, batch, cfg: LossConfig):
    """DAPO: loss = −J, J = (1/Σ_i |y_i|) Σ_i Σ_t sg[w_t] · min(r_t Â, clip(r_t, 1−ε_low,
    1+ε_high) Â): clip-higher (DAPO: ε_low = 0.2, ε_high = 0.28; set eps_high), token-mean
    aggregation; w as in `grpo` (use_is=False: DAPO's own). Dynamic sampling and overlong
    shaping act on the data, not here."""
    return _ppo(logp_BxT, batch, cfg, "dapo")


def cispo(logp_BxT, batch, cfg: LossConfig):
    """CISPO (App. A form, docs/method.md §5): loss = −J,
        J = (1/Σ_i |y_i|) Σ_i Σ_t sg[w_t · clip(r_t, 1−ε_low, 1+ε_high)] · Â · log π_θ(y_t).
    Every token keeps its gradient (the weight is clipped, never the token); w as in `grpo`
    (use_is=False: App. A's w ≡ 1). MiniMax's CISPO clips only above: eps_low near 1 (e.g.
    0.999) approximates it. clip=False: r unclipped. clip/frac_* count clipped weights, any Â."""
    p = _parts(logp_BxT, batch, cfg)
    r = jnp.exp(sg(_clip(p.log_r, cfg)))
    rc = jnp.clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) if cfg.clip else r
    w, altered = _engine_weight(p, cfg)
    term = sg(w * rc) * p.adv * p.logp
    loss = -_objective(term, p, batch, cfg, "cispo")
    hi = (r > 1 + cfg.eps_high) & cfg.clip
    lo = (r < 1 - cfg.eps_low) & cfg.clip
    return _finish(p, batch, cfg, loss, w, altered, hi, lo)


def _gspo(logp_BxT, batch, cfg: LossConfig, name: str, token_level: bool):
    p = _parts(logp_BxT, batch, cfg)
    length = jnp.maximum(jnp.sum(p.m, axis=1, keepdims=True), 1.0)
    log_s = jnp.sum(p.log_r * p.m, axis=1, keepdims=True) / length  # (1/|y|) Σ_t log r_t
    log_s = jnp.broadcast_to(log_s, p.m.shape)
    if token_level:  # value sg[s_i], gradient s_i ∇log π_θ(y_t)
        log_s = sg(log_s) + p.logp - sg(p.logp)
    # The sequence log-ratio is clamped after it is formed (tunix, verl: at ≤ 10): beyond,
    # the term is a constant with no gradient.
    log_s = jnp.clip(log_s, -cfg.max_log_ratio, cfg.gspo_max_log_ratio)
    s = jnp.exp(log_s)
    lo_b, hi_b = 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high
    term = jnp.minimum(s * p.adv, jnp.clip(s, lo_b, hi_b) * p.adv) if cfg.clip else s * p.adv
    w, altered = _engine_weight(p, cfg)
    loss = -_objective(sg(w) * term, p, batch, cfg, name)
    hi, lo = clip_sides(p.adv, log_s, lo_b, hi_b, cfg.clip)
    return _finish(p, batch, cfg, loss, w, altered, hi, lo)


def gspo(logp_BxT, batch, cfg: LossConfig):
    """GSPO: loss = −J, s_i = exp((1/|y_i|) Σ_t log r_t),
        J = (1/B) Σ_i (1/|y_i|) Σ_t sg[w_t] · min(s_i Â_i, clip(s_i, 1−ε'_low, 1+ε'_high) Â_i),
    ε' = gspo_eps_low / gspo_eps_high, a tiny range (GSPO: 3e-4 / 4e-4). w ≡ 1 (use_is=False,
    GSPO's form): the inner mean is GSPO's per-response term; use_is averages the engine weight
    over the response (one per response with is_correction='seq_geomean'); advantages_BxT: each
    token's min uses its own Â_t."""
    return _gspo(logp_BxT, batch, cfg, "gspo", token_level=False)


def gspo_token(logp_BxT, batch, cfg: LossConfig):
    """GSPO-token: `gspo` with s_it = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)] and Â_it; equal in value
    and, for a per-response Â, in gradient, but per-token Â weight each token's gradient."""
    return _gspo(logp_BxT, batch, cfg, "gspo_token", token_level=True)


# Name -> loss function: the rows of loss_table.LOSS_TABLE, loaded (a row naming a
# function of this module finds it here, this module being mid-import but past its
# definitions).
LOSSES = {name: row.load() for name, row in LOSS_TABLE.items()}

# Named settings of the paper's runs and of the namesake methods (docs/method.md §4, §5).
LOSS_PRESETS = {
    "minirl": LossConfig(),
    "minirl_length_norm": LossConfig(aggregation="seq_mean_token_mean"),
    "minirl_no_is": LossConfig(use_is=False),
    "minirl_no_clip": LossConfig(clip=False),
    "grpo": LossConfig(name="grpo", use_is=False, advantage="group_norm"),
    "grpo_tis": LossConfig(name="grpo", advantage="group_norm"),
    "cispo": LossConfig(name="cispo", use_is=False, advantage="group_norm"),
    "gspo": LossConfig(name="gspo", use_is=False, advantage="group_norm"),
    "gspo_token": LossConfig(name="gspo_token", use_is=False, advantage="group_norm"),
    "dapo": LossConfig(name="dapo", use_is=False, eps_high=0.28, advantage="group_norm"),
    # IcePop masks on the engine ratio π_old/μ_old, not on π_θ/μ_old (equal on the first
    # mini-batch of a step, different on stale ones).
    "minirl_icepop": LossConfig(is_correction="icepop", cap_target="engine"),
    "minirl_seq_geomean": LossConfig(is_correction="seq_geomean"),
}
