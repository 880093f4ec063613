"""Accumulation dtype, mask value and kernel product precision shared by ops and model."""
import jax
import jax.numpy as jnp

# What a masked logit or attention score is set to (and where an online log-sum-exp's
# running max starts): the most negative float32, not −inf. Beside any real entry
# exp(MASK_VALUE − max) underflows to exactly 0, as with −inf; but a row with every entry
# masked stays finite (its softmax is uniform, not NaN), and MASK_VALUE − m for a real
# max |m| < 1e31 rounds back to MASK_VALUE instead of overflowing. Logits and scores are
# float32 or wider (`accum_dtype`), where it is representable; a Python float, so it
# never promotes the array it fills.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def accum_dtype(dtype):
    """Accumulation / softmax dtype: float32, or float64 for float64 `dtype` (numerical
    reference runs under `jax.enable_x64`)."""
    return jnp.promote_types(dtype, jnp.float32)


def kernel_precision(dtype):
    """Pallas matmul precision for `dtype` operands: HIGHEST for float32 and wider (full
    products, not TF32 or one bf16 pass); the native pass for 16-bit ones, whose products
    are exact (and Mosaic rejects an fp32 contract precision on them)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None
