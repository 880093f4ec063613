"""Numerics policies: how a forward pass computes, so one engine can differ from another.

Training runs "train"; the inference engine runs a preset reproducing a real inference engine's
kinds of numerical difference from the trainer for the *same* weights:

| preset | weights                              | activations | router logits        |
|--------|--------------------------------------|-------------|----------------------|
| train  | model param dtype                    | cfg dtype   | cfg dtype, ≥ float32 |
| exact  | same as train (sanity baseline)      | cfg dtype   | cfg dtype, ≥ float32 |
| bitwise| exact, under ModelConfig.batch_invariant (model/invariant.py): no mismatch |
| bf16   | bfloat16                             | bfloat16    | bfloat16             |
| fp8    | e4m3, per-output-channel scales      | bfloat16    | bfloat16             |

Every model matmul passes `precision=PRECISION` (HIGHEST) and accumulates in float32 or wider
(`accum_dtype`): float32 is float32 on a CPU, an NVIDIA GPU (no TF32) and a TPU (no single bf16
pass), so `exact` computes what `train` does on each, free for bfloat16 operands (exact in every
fast path). Backends still differ in the order of float32 sums: rounding, not precision.

Knobs on any preset sweep the mismatch: `act_fp8` (per-token e4m3 quantization of matmul inputs),
`router_noise_std` (seeded Gaussian noise on router logits).

FP8 is simulated by quantize→dequantize: stored values are exactly e4m3 times a channel scale
(the real rounding error), multiplied in bfloat16 with float32 accumulation as accelerator FP8
GEMMs accumulate wider; embedding, unembedding, router and norms stay bfloat16/float32, as in FP8
inference engines.

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
    """How a forward pass computes (`name`: for logs). `weights`: 'native' (as stored), 'bf16' or
    'fp8' (e4m3, per-channel scale); `compute_dtype`: activations' (None: the model config's);
    `router_dtype`: the router matmul's (None: compute dtype, at least float32, as the trainer;
    expert softmax: float32 or wider); `act_fp8`: per-token e4m3 matmul inputs;
    `router_noise_std`: std of Gaussian router-logit noise (0 = off) seeded by `noise_seed`, a
    function of (seed, layer, position, token id) only, so prefill and decode agree whatever the
    other rows."""

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
    """The sampling engine's numerics: preset plus mismatch knobs, noise seeded by the run."""
    preset = numerics_preset(sampling.numerics, router_noise_std=sampling.router_noise_std,
                             act_fp8=sampling.act_fp8, noise_seed=seed)
    return preset.replace(router_dtype=sampling.router_dtype) if sampling.router_dtype else preset


def compute_dtype(numerics: Numerics, cfg_compute_dtype: str):
    return dtype_of(numerics.compute_dtype or cfg_compute_dtype)


def quantize_e4m3(x: jax.Array, axes: tuple[int, ...]) -> dict:
    """x as {"values": e4m3, "scale": float32 per slice over `axes`}, x ≈ values · scale with
    amax mapped to 448 (e4m3's max). The values sit behind an optimization barrier, else XLA's
    GPU compiler folds the float32 → e4m3 → float32 round trip, and the mismatch, away."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jax.lax.optimization_barrier((x32 / scale).astype(jnp.float8_e4m3fn))
    return {"values": q, "scale": scale}


def dequantize(w) -> jax.Array:
    """A weight as the FP8 engine uses it: bfloat16(e4m3 · scale) for a `quantize_e4m3` dict
    (`fake_quant_e4m3`'s rounding: both forms give the same matmul inputs); else as is."""
    if not is_quantized(w):
        return w
    return (w["values"].astype(jnp.float32) * w["scale"]).astype(jnp.bfloat16)


def is_quantized(w) -> bool:
    return isinstance(w, dict) and set(w) == {"values", "scale"}


def axes_like(w, axes):
    """Logical axes of a weight as stored: a quantized weight's values and scales share them (the
    scales' contraction dims are 1, left replicated)."""
    return {"values": axes, "scale": axes} if is_quantized(w) else axes


def fake_quant_e4m3(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Round x to e4m3 with one float32 scale per slice over `axes`; returns float32."""
    q = quantize_e4m3(x, axes)
    return q["values"].astype(jnp.float32) * q["scale"]


def prepare_params(params: dict, numerics: Numerics, *, keep_quantized: bool = False,
                   store_fp8: bool | None = None) -> dict:
    """The weights as this engine holds them ('native': as is), converted once per rollout (as an
    engine at load) behind an optimization barrier so no rounding is fused away. keep_quantized
    (serving layout, rollout.py): `quantize_e4m3` dicts (1 byte a value) `dequantize`d per layer,
    not bfloat16 (2 bytes), same matmul inputs; `store_fp8`: its old name."""
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
