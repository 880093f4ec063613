"""The one rule for floating-point comparisons in the tests.

Rounding model (Higham, *Accuracy and Stability of Numerical Algorithms*, §2–3). A type
with unit roundoff u (half an ulp of 1: float64 2⁻⁵³, float32 2⁻²⁴, float16 2⁻¹¹,
bfloat16 2⁻⁸) rounds each operation with relative error ≤ u, and n successive roundings
with relative error ≤ γ_n = n·u / (1 − n·u). A sum or dot product of n terms, evaluated in
any order, is within γ_{n−1} · Σ|terms| of the exact value. Two evaluations that differ
only in the order of their sums (another CPU's vector width, a sharded reduction, dense vs
grouped dispatch, remat, KV-cache decode vs a full pass, a GPU) are therefore within
2·γ_n · Σ|terms| of each other, and a float32 result is within γ_n · Σ|terms| of a float64
reference.

`assert_close` checks exactly that bound:

    |actual − desired| ≤ 2 · γ_n(u) · cond · scale

- n: roundings on the longest dependency path of the computed value: the reduction
  lengths it passes through plus its elementwise operations (a call site says how it
  counted; `forward_chain` counts one for the model).
- cond: Σ|terms| / |Σ terms|, the condition number of the final reduction, 1 when
  nothing cancels. A quantity that is a difference of nearly equal numbers (a log-ratio, a
  centred reward) needs its cond, or a `scale` that is the size of the cancelled terms.
- scale: |desired| elementwise (default); "max" for ‖desired‖_∞, a norm-wise comparison,
  for tensors whose small entries carry large relative error (gradients, hidden states);
  or a number, the magnitude of the terms, for values that cancel to about 0.
- The factor 2 covers two rounded computations; against a float64 reference it is a
  2× margin.

The chain rule for a composition of stages (layers) adds their γ's: γ_a + γ_b ≤ γ_{a+b},
to first order, when each stage has relative condition ≤ 1. RMS-normalized residual blocks
with softmax attention and gates meet that at initialization, which is where the tests
evaluate them; `forward_chain` counts on it.

Long float32 chains. The worst-case γ_n grows like n and, past a thousand roundings,
stops separating rounding from real differences (n = 1,400 gives 8e-5 relative, more
than the bf16 engine's mean log-prob gap). Rounding errors behave as independent,
zero-mean variables, and the probabilistic bound of Higham & Mary (SIAM J. Sci. Comput.
41(5), 2019, Thm. 2.4) replaces n·u by λ·√n·u:

    γ̃_n(λ) = exp(λ·√n·u + n·u²/(1 − u)) − 1,

holding for each computed value with probability ≥ 1 − 2·exp(−λ²(1 − u)²/2). `lam=LAMBDA`
(λ = 6: failure probability 3e-8 per value, < 1e-4 over the few thousand values a test
compares) selects it; the tests of the two `exact` engines use it.

Where a test checks algebra rather than rounding (two algorithms for one function), it
runs in float64 under `jax.enable_x64`: γ_n is then ~1e-13 for every n used here, while
any algorithmic difference (a wrong route, a dropped token, a missed mask) moves values by
1e-4 or more, so the comparison cannot confuse the two and does not depend on the
machine. float32 comparisons are kept for what is specifically about float32: the two
engines of the `exact` preset, and hand-derived values of float32 code.
"""
from __future__ import annotations

import numpy as np

UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11,
                 "bfloat16": 2.0**-8}


def unit_roundoff(dtype) -> float:
    """u of a dtype (numpy / jax dtype or its name)."""
    name = getattr(dtype, "name", None) or np.dtype(dtype).name
    return UNIT_ROUNDOFF[name]


LAMBDA = 6.0  # confidence parameter of the probabilistic bound (module docstring)


def gamma(n: int, dtype="float32", lam: float | None = None) -> float:
    """γ_n = n·u / (1 − n·u), the worst-case relative error of n roundings; with `lam`,
    the probabilistic γ̃_n(λ) = exp(λ√n·u + n·u²/(1 − u)) − 1."""
    u = unit_roundoff(dtype)
    if lam is not None:
        return float(np.expm1(lam * np.sqrt(n) * u + n * u * u / (1 - u)))
    if n * u >= 1:
        raise ValueError(f"gamma: n={n} roundings exhaust {dtype} precision; compare in "
                         "float64 instead")
    return n * u / (1 - n * u)


def bound(n: int, dtype="float32", cond: float = 1.0, lam: float | None = None) -> float:
    """2·γ_n·cond: the relative tolerance `assert_close` applies (for rtol= of other APIs,
    e.g. pytest.approx(rel=bound(...)))."""
    return 2 * gamma(n, dtype, lam) * cond


def assert_close(actual, desired, *, n: int, dtype="float32", cond: float = 1.0,
                 scale=None, lam: float | None = None, err_msg: str = "") -> None:
    """Assert |actual − desired| ≤ 2·γ_n(u_dtype)·cond·scale (see the module docstring);
    `lam` selects the probabilistic γ̃_n(λ).

    scale: None → |desired| elementwise; "max" → max |desired| (norm-wise); a number → that
    magnitude. NaN anywhere fails.
    """
    a = np.asarray(actual, np.float64)
    d = np.asarray(desired, np.float64)
    if a.shape != d.shape and a.size != 1 and d.size != 1:
        raise AssertionError(f"shapes differ: {a.shape} vs {d.shape}. {err_msg}")
    if scale is None:
        s = np.abs(d)
    elif scale == "max":
        s = np.max(np.abs(d)) if d.size else 0.0
    else:
        s = float(scale)
    tol = bound(n, dtype, cond, lam) * s
    err = np.abs(a - d)
    bad = ~(err <= tol)  # NaN compares False: a NaN fails
    if np.any(bad):
        i = np.unravel_index(np.argmax(np.where(bad, err - tol, -np.inf)), bad.shape) \
            if bad.ndim else ()
        raise AssertionError(
            f"{int(np.sum(bad))} of {bad.size} values outside 2·γ_{n}({dtype})·cond={cond}"
            f" × scale: at {i} actual {a[i] if a.ndim else a} desired {d[i] if d.ndim else d} "
            f"|err| {err[i] if err.ndim else err:.3g} > tol "
            f"{np.broadcast_to(tol, err.shape)[i] if err.ndim else tol:.3g}. {err_msg}")


def forward_chain(cfg, seq_len: int) -> int:
    """Roundings on the longest path through `transformer.forward` of a ModelConfig:
    per layer, RMSNorm (D) → q/k/v projection (D) → q/k RMSNorm (Dh) → RoPE (2) → scores
    (Dh) → softmax and weighted sum over the keys (2·S) → output projection (H·Dh) →
    RMSNorm (D) → router (D) and softmax (E) → gate/up (D) → down (F) → combine (K), plus
    ~16 elementwise ops; then the final RMSNorm (D)."""
    d, dh, h = cfg.d_model, cfg.head_dim, cfg.num_heads
    per_layer = (d + d + dh + 2 + dh + 2 * seq_len + h * dh + d + d + cfg.num_experts + d
                 + cfg.expert_ffn_dim + cfg.top_k + 16)
    return cfg.num_layers * per_layer + d


def backward_chain(cfg, seq_len: int, tokens: int) -> int:
    """A gradient: the forward path, the same path transposed, and the sum over the
    `tokens` (batch × sequence) positions that every weight gradient reduces over."""
    return 2 * forward_chain(cfg, seq_len) + tokens


def engine_chain(cfg, slots: int) -> int:
    """A token log-prob: the forward path over `slots` positions, the logit dot (D) and the
    log-sum-exp over the vocabulary (V), plus a few elementwise ops."""
    return forward_chain(cfg, slots) + cfg.d_model + cfg.vocab_size + 4
