"""The accumulation dtype every op and the model share."""
import jax.numpy as jnp


def accum_dtype(dtype):
    """Accumulation / softmax dtype for operands of `dtype`: float32, or float64 for
    float64 operands (numerical reference runs under `jax.enable_x64`)."""
    return jnp.promote_types(dtype, jnp.float32)
