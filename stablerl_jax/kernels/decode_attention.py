"""Decode attention (a sampler decode step): one query per row against the KV cache,
read in blocks. `decode_attention(..., impl=name)` runs a row of
decode_attention_impls.DECODE_IMPLS; `blocks` (pure JAX) is the reference; the Pallas
kernel is in decode_attention_pallas.py.

Letters: B rows, KV kv heads, Hg query heads per kv head, Dh head width, S key slots,
X slots of one block.

Contract: out_BxKVxHgxDh = fn(q_BxKVxHgxDh, k, v, key_mask_BxS, last_slot, *, block,
keys, layer). Row b's query sits at slot last_slot (a scalar: every row writes the same
slot, as left-padded prompts do; or [B], one per row, in the continuous sampler) and
attends to the slots [0, last_slot[b]] that key_mask_BxS marks real, by an online
softmax over blocks of `block` slots (flash-decoding's running max m, normalizer l,
output o) in float32 (float64 for float64 operands); a row with no real key gets zeros,
not NaN. k, v: the cache in layout `keys` ("bksd": [B, KV, S, Dh]; "bskd": [B, S, KV,
Dh]), or with `layer` the stacked [L, ...] cache, each block sliced from layer `layer`
directly (slicing the layer first would copy its whole cache every layer and step: the
slice feeds a loop, so XLA materializes it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stablerl_jax.kernels import lookup
from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS
from stablerl_jax.kernels.dtypes import MASK_VALUE, accum_dtype

PRECISION = jax.lax.Precision.HIGHEST  # full float32 products, as the model's matmuls


def _dot(eq, a, b, dtype):
    return jnp.einsum(eq, a.astype(dtype), b.astype(dtype), precision=PRECISION,
                      preferred_element_type=accum_dtype(dtype))


def _block_of(cache, start, block: int, s_axis: int, layer=None):
    """`block` slots of `cache` from slot `start`; of layer `layer` of a stacked cache."""
    blk = jax.lax.dynamic_slice_in_dim(cache, start, block, s_axis)
    return blk if layer is None else jax.lax.dynamic_index_in_dim(blk, layer, 0, False)


def blocks(q_BxKVxHgxDh, k, v, key_mask_BxS, last_slot, *, block: int, keys: str = "bksd",
           layer=None):
    """The reference: ⌈(max_b last_slot[b] + 1) / block⌉ loop trips over all rows at once,
    each reading every row's blocks up to the largest row's. A block that would run past S
    starts at S − block; its slots before j · block, read by the previous block, are masked."""
    s_axis = keys.index("s") + (layer is not None)
    s = k.shape[s_axis]
    block = min(block, s)
    dtype = q_BxKVxHgxDh.dtype
    acc = accum_dtype(dtype)
    b, kv, g, dh = q_BxKVxHgxDh.shape
    kx = keys.replace("s", "x")
    last_Bx1 = jnp.reshape(jnp.asarray(last_slot, jnp.int32), (-1, 1))  # [1, 1] or [B, 1]

    def body(j, carry):
        m_BxKVxHg, l_BxKVxHg, o_BxKVxHgxDh = carry
        start = jnp.minimum(j * block, s - block)
        k_blk, v_blk = (_block_of(c, start, block, s_axis, layer) for c in (k, v))
        slots_X = start + jnp.arange(block)  # X slots of this block
        allowed_BxX = (slots_X >= j * block)[None] & (slots_X[None] <= last_Bx1) & (
            jax.lax.dynamic_slice_in_dim(key_mask_BxS, start, block, 1).astype(bool))
        scores_BxKVxHgxX = _dot(f"bkgd,{kx}->bkgx", q_BxKVxHgxDh, k_blk, dtype) * dh**-0.5
        scores_BxKVxHgxX = jnp.where(allowed_BxX[:, None, None], scores_BxKVxHgxX,
                                     MASK_VALUE)
        m_new = jnp.maximum(m_BxKVxHg, jnp.max(scores_BxKVxHgxX, axis=-1))
        p_BxKVxHgxX = jnp.where(allowed_BxX[:, None, None],
                                jnp.exp(scores_BxKVxHgxX - m_new[..., None]), 0)
        corr = jnp.exp(m_BxKVxHg - m_new)
        pv = _dot(f"bkgx,{kx}->bkgd", p_BxKVxHgxX, v_blk, dtype)
        return (m_new, l_BxKVxHg * corr + jnp.sum(p_BxKVxHgxX, axis=-1),
                o_BxKVxHgxDh * corr[..., None] + pv)

    init = (jnp.full((b, kv, g), MASK_VALUE, acc), jnp.zeros((b, kv, g), acc),
            jnp.zeros((b, kv, g, dh), acc))
    _, l_BxKVxHg, o_BxKVxHgxDh = jax.lax.fori_loop(0, jnp.max(last_Bx1) // block + 1, body,
                                                   init)
    out = o_BxKVxHgxDh / jnp.where(l_BxKVxHg > 0, l_BxKVxHg, 1)[..., None]
    return out.astype(dtype)


def decode_attention(q_BxKVxHgxDh, k, v, key_mask_BxS, last_slot, *, block: int,
                     keys: str = "bksd", layer=None, impl: str = "blocks",
                     interpret: bool = False):
    """Row `impl` of DECODE_IMPLS (module docstring); `interpret`: `Impl.load`."""
    fn = lookup(DECODE_IMPLS, impl, "decode_attention: impl").load(interpret=interpret)
    return fn(q_BxKVxHgxDh, k, v, key_mask_BxS, last_slot, block=block, keys=keys,
              layer=layer)
