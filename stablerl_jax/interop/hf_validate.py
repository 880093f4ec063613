"""What a Hugging Face checkpoint's tensors must hold before training starts from them:
the dtype config.json declares (`torch_dtype`), and finite values.

Else an int32 or float16 tensor in a float32 checkpoint is cast silently on load, and a
NaN or inf trains with every update skipped (rl/step_fns.apply_gradients refuses them)
while the run exits 0. Dtypes come from the safetensors headers, before any data;
finiteness is one jitted pass over the sharded parameters to one flag per HF tensor (per
layer, and per expert where stacked), so the error names the tensor and its file.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.interop.hf_config import model_config_from_hf

# safetensors header dtype -> numpy-style name.
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def declared_dtype(path: str) -> str:
    """config.json's torch_dtype, normalised as the model config reads it."""
    with open(os.path.join(path, "config.json")) as f:
        return model_config_from_hf(json.load(f)).param_dtype


def check_dtypes(ckpt, names, path: str) -> None:
    """Every tensor in `names` must have the dtype config.json declares."""
    want = declared_dtype(path)
    for n in names:
        got = ckpt.slice(n).get_dtype()
        got = _ST_DTYPES.get(got, got)
        if got != want:
            raise ValueError(
                f"checkpoint {path}: tensor {n} in {os.path.basename(ckpt.where[n])} is "
                f"{got}, but config.json's torch_dtype is {want}; convert the tensor to "
                f"{want}, or correct torch_dtype if the whole checkpoint is {got} (it is "
                "never cast silently)")


@functools.partial(jax.jit, static_argnames="stacked")
def _finite_flags(leaves: dict, stacked: tuple) -> dict:
    axes = dict(stacked)
    return {k: jnp.all(jnp.isfinite(x), axis=tuple(range(axes[k], x.ndim)))
            for k, x in leaves.items()}


def nonfinite(leaves: dict, stacked: dict) -> dict:
    """{leaf: indices over its stacked axes (layer[, expert]) of blocks holding NaN or inf}
    for leaves with any; `stacked[leaf]`: leading axes stacking HF tensors (0, 1 or 2)."""
    flags = jax.device_get(_finite_flags(leaves, tuple(sorted(stacked.items()))))
    return {k: [tuple(int(i) for i in ix) for ix in np.argwhere(~np.asarray(f))]
            for k, f in flags.items() if not np.all(f)}
