"""Numerics policies: how a forward pass computes, so one engine can differ from another.

The training path runs the "train" policy. The sampling path (the inference engine) runs
one of the inference presets, which reproduce the kinds of numerical differences a real
inference engine has from the trainer for the *same* weights:

| preset | weights                              | activations | router logits        |
|--------|--------------------------------------|-------------|----------------------|
| train  | model param dtype                    | cfg dtype   | cfg dtype, ≥ float32 |
| exact  | same as train (sanity baseline)      | cfg dtype   | cfg dtype, ≥ float32 |
| bitwise| exact, under ModelConfig.batch_invariant (model/invariant.py): no mismatch |
| bf16   | bfloat16                             | bfloat16    | bfloat16             |
| fp8    | e4m3, per-output-channel scales      | bfloat16    | bfloat16             |

Matmul precision is the same on every backend: every model matmul passes
`precision=PRECISION` (HIGHEST) and accumulates in float32 or wider (`accum_dtype`). A
float32 matmul is therefore a float32 matmul on a CPU, on an NVIDIA GPU (no TF32) and on
a TPU (no single bf16 pass), and `exact` computes exactly what `train` computes on each of
them. bfloat16 operands are exact in every backend's fast path, so the setting costs
nothing where compute_dtype is bfloat16, which is how a run asks for speed. What still
differs between backends is the order of float32 sums (vector widths, tilings), i.e.
rounding, not precision.

Knobs on top of any preset: `act_fp8` (per-token e4m3 quantization of every matmul input)
and `router_noise_std` (seeded Gaussian noise on router logits) sweep the mismatch.

FP8 is simulated by quantize→dequantize: the stored value is exactly an e4m3 number times
its channel scale, so the rounding error is the real one; the matmul then runs in
bfloat16 with float32 accumulation, as FP8 GEMMs on accelerators accumulate in wider
precision. Embedding, unembedding, router and norms stay in bfloat16/float32, as FP8
inference engines keep them.

Letters: B batch, T tokens, D model, E experts.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from stablerl_jax.config import DTYPES, INFERENCE_NUMERICS, SamplingConfig, check
from stablerl_jax.kernels.dtypes import accum_dtype  # noqa: F401 (the model's name for it)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
           "float64": jnp.float64}
assert set(_DTYPES) == set(DTYPES)


def dtype_of(name: str):
    """The jnp dtype of a config dtype name (config.DTYPES)."""
    return _DTYPES[name]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
PRECISION = jax.lax.Precision.HIGHEST  # of every model matmul (module docstring)



# Contraction (input) axes of each stacked layer weight; scales are per output channel,
# i.e. one scale for every index of the remaining axes.
_QUANT_AXES = {
    "wq": (1,), "wk": (1,), "wv": (1,), "wo": (1, 2),
    "w_gate": (2,), "w_up": (2,), "w_down": (2,),
}


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How a forward pass computes.

    Attributes:
      name: preset name (for logs).
      weights: 'native' (params as stored), 'bf16', or 'fp8' (e4m3, per-channel scale).
      compute_dtype: activation dtype; None means the model config's compute_dtype.
      router_dtype: dtype of the router matmul; None means the compute dtype widened to
        at least float32 (the training engine's choice). The softmax over experts is in
        float32 or wider.
      act_fp8: quantize each matmul input per token to e4m3 (plus scale).
      router_noise_std: std of Gaussian noise added to router logits (0 = off).
      noise_seed: seed of that noise. The noise of a token depends only on
        (seed, layer, position, token id), so it is identical in prefill and decode and
        independent of the other rows of the batch.
    """

    name: str = "train"
    weights: str = "native"
    compute_dtype: str | None = None
    router_dtype: str | None = None
    act_fp8: bool = False
    router_noise_std: float = 0.0
    noise_seed: int = 0

    def __post_init__(self):
        check(self.weights in ("native", "bf16", "fp8"), "weights",
              f"must be 'native', 'bf16' or 'fp8', got {self.weights!r}")
        for f in ("compute_dtype", "router_dtype"):
            v = getattr(self, f)
            check(v is None or v in DTYPES, f,
                  f"must be None or a float dtype name, got {v!r}")
        check(self.router_noise_std >= 0, "router_noise_std",
              f"must be >= 0, got {self.router_noise_std}")

    def replace(self, **kw) -> "Numerics":
        return dataclasses.replace(self, **kw)


NUMERICS_PRESETS = {
    "train": Numerics("train"),
    "exact": Numerics("exact"),
    "bf16": Numerics("bf16", weights="bf16", compute_dtype="bfloat16", router_dtype="bfloat16"),
    "fp8": Numerics("fp8", weights="fp8", compute_dtype="bfloat16", router_dtype="bfloat16"),
    "bitwise": Numerics("bitwise"),  # `exact` under ModelConfig.batch_invariant
}
TRAIN = NUMERICS_PRESETS["train"]
assert set(NUMERICS_PRESETS) == {"train", *INFERENCE_NUMERICS}


def numerics_preset(name: str, **overrides) -> Numerics:
    """A named preset, optionally with knobs overridden (e.g. router_noise_std=0.01)."""
    if name not in NUMERICS_PRESETS:
        raise ValueError(f"numerics preset: unknown {name!r}; choose one of "
                         f"{sorted(NUMERICS_PRESETS)}")
    return NUMERICS_PRESETS[name].replace(**overrides) if overrides else NUMERICS_PRESETS[name]


def of_sampling(sampling: SamplingConfig, seed: int) -> Numerics:
    """The sampling engine's numerics: its preset plus the mismatch knobs, the router
    noise seeded by the run's seed."""
    preset = numerics_preset(sampling.numerics, router_noise_std=sampling.router_noise_std,
                             act_fp8=sampling.act_fp8, noise_seed=seed)
    return preset.replace(router_dtype=sampling.router_dtype) if sampling.router_dtype else preset


def compute_dtype(numerics: Numerics, cfg_compute_dtype: str):
    return dtype_of(numerics.compute_dtype or cfg_compute_dtype)


def quantize_e4m3(x: jax.Array, axes: tuple[int, ...]) -> dict:
    """x as {"values": e4m3 values, "scale": one float32 scale per slice over `axes`}
    (kept dims of size 1), x ≈ e4m3 · scale.

    Scale = amax / 448 so the largest element maps to e4m3's largest finite value. The
    e4m3 values pass an optimization barrier: XLA's GPU compiler otherwise folds a
    float32 → e4m3 → float32 round trip away (excess precision), and the simulated
    mismatch would vanish on that backend.
    """
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jax.lax.optimization_barrier((x32 / scale).astype(jnp.float8_e4m3fn))
    return {"values": q, "scale": scale}


def dequantize(w) -> jax.Array:
    """A weight as the FP8 engine computes with it: bfloat16(e4m3 · scale) for a
    `quantize_e4m3` dict (the same rounding as `fake_quant_e4m3`, so both storage forms
    give bit-identical matmul inputs), any other array unchanged."""
    if not is_quantized(w):
        return w
    return (w["values"].astype(jnp.float32) * w["scale"]).astype(jnp.bfloat16)


def is_quantized(w) -> bool:
    return isinstance(w, dict) and set(w) == {"values", "scale"}


def axes_like(w, axes):
    """A weight's logical axes in its stored form: a quantized weight's values and scales
    share them (the scales' contraction dims are 1, which sharding leaves replicated)."""
    return {"values": axes, "scale": axes} if is_quantized(w) else axes


def fake_quant_e4m3(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Round x to e4m3 with one float32 scale per slice over `axes`; returns float32."""
    q = quantize_e4m3(x, axes)
    return q["values"].astype(jnp.float32) * q["scale"]


def prepare_params(params: dict, numerics: Numerics, *, keep_quantized: bool = False,
                   store_fp8: bool | None = None) -> dict:
    """The weights as this engine holds them. Identity for 'native'.

    Called once per rollout (outside the decode loop), as an inference engine converts
    its weights once at load time. The converted weights pass an optimization barrier, so
    a compiler cannot fuse the rounding into their consumers and skip it.

    keep_quantized (the serving layout, rollout.py): each quantized layer weight is kept
    as a `quantize_e4m3` dict (1 byte per value plus per-channel scales) and
    `dequantize`d inside the layer that uses it, not as its bfloat16 rounding (2 bytes);
    the matmul inputs are the same bits either way. `store_fp8` is its old name.
    """
    if store_fp8 is not None:
        warnings.warn("prepare_params(store_fp8=) is now keep_quantized=", DeprecationWarning,
                      stacklevel=2)
        keep_quantized = store_fp8
    if numerics.weights == "native":
        return params
    bf16 = lambda a: a.astype(jnp.bfloat16)
    out = jax.tree.map(bf16, params)
    if numerics.router_dtype and jnp.dtype(dtype_of(numerics.router_dtype)).itemsize > 2:
        # A full-precision router (sampling.router_dtype): its weights stay unrounded.
        out["layers"] = dict(out["layers"], router=params["layers"]["router"])
    if numerics.weights == "fp8":
        layers = dict(out["layers"])
        for name, axes in _QUANT_AXES.items():
            q = quantize_e4m3(params["layers"][name], axes)
            layers[name] = q if keep_quantized else dequantize(q)
        out["layers"] = layers
    return jax.lax.optimization_barrier(out)


def act_quant(x_TxD: jax.Array, numerics: Numerics) -> jax.Array:
    """Per-token e4m3 quantization of a matmul input when `act_fp8` is on."""
    if not numerics.act_fp8:
        return x_TxD
    return fake_quant_e4m3(x_TxD, (-1,)).astype(x_TxD.dtype)


def router_noise(numerics: Numerics, layer: jax.Array, positions_BxT: jax.Array,
                 tokens_BxT: jax.Array, num_experts: int) -> jax.Array:
    """Seeded N(0, std²) noise on router logits, [B, T, E] float32, or 0.0 when off."""
    if numerics.router_noise_std == 0.0:
        return jnp.zeros((), jnp.float32)
    base = jax.random.fold_in(jax.random.key(numerics.noise_seed), layer)

    def one(pos, tok):
        k = jax.random.fold_in(jax.random.fold_in(base, pos), tok)
        return jax.random.normal(k, (num_experts,), jnp.float32)

    noise = jax.vmap(jax.vmap(one))(positions_BxT, tokens_BxT)
    return numerics.router_noise_std * noise
