"""The decode attention's table: implementations and example shapes. No JAX (the config
validates ModelConfig.decode_attention_impl against `DECODE_IMPLS`).

Letters: B rows, KV kv heads, Hg query heads per kv head, Dh head width, S key slots.

Every implementation computes out_BxKVxHgxDh = fn(q_BxKVxHgxDh, k, v, key_mask_BxS,
last_slot, *, block, keys, layer[, interpret=]) (contract: decode_attention.py;
`decode_attention.decode_attention(..., impl=name)` runs a row); the reference is "blocks".
"""
from __future__ import annotations

import dataclasses

from stablerl_jax.kernels import Arg, Impl


@dataclasses.dataclass(frozen=True)
class DecodeImpl(Impl):
    """A row of DECODE_IMPLS. ragged: it reads only each row's own key blocks, of a
    head-major ('bksd') cache in blocks of model.decode_block (the config requires both),
    and the sampler's schedules are priced per row (schedule_prices.SamplerPrices). tokens:
    its per-token attention (decode_attention_pallas.tokens: each result fixed by its query
    alone), which both engines run under batch-invariant numerics (model/invariant.py);
    None: they run `invariant.attend`'s own blocks."""

    ragged: bool = False
    tokens: Impl | None = None


_OP = "stablerl_jax.kernels.decode_attention"
DECODE_IMPLS: dict[str, DecodeImpl] = {
    # The reference: pure JAX, every row's key blocks up to the largest row's last slot.
    "blocks": DecodeImpl(f"{_OP}:blocks", ("cpu", "gpu", "tpu")),
    # The ragged Pallas kernel (decode_attention_pallas.py) compiled by Mosaic: each row
    # reads its own blocks only.
    "pallas_tpu": DecodeImpl(f"{_OP}_pallas:pallas", ("tpu",), {"target": "tpu"},
                             pallas=True, ragged=True,
                             tokens=Impl(f"{_OP}_pallas:tokens", ("tpu",), {"target": "tpu"},
                                         pallas=True)),
}


def decode_example_args(rows: int, model, slots: int) -> tuple[tuple[Arg, ...], dict]:
    """(arguments, static keywords) of one layer's decode attention of `model` (a
    ModelConfig): `rows` rows per device, a `slots`-slot head-major cache, all split by row."""
    kv, dh = model.num_kv_heads, model.head_dim
    g, dt = model.num_heads // kv, model.compute_dtype
    return (Arg("q_BxKVxHgxDh", (rows, kv, g, dh), dt, True, False),
            Arg("k", (rows, kv, slots, dh), dt, True, False),
            Arg("v", (rows, kv, slots, dh), dt, True, False),
            Arg("key_mask_BxS", (rows, slots), "bool", True, False),
            Arg("last_slot", (rows,), "int32", True, False)), {
                "block": model.decode_block or 512, "keys": "bksd"}


def tokens_example_args(rows: int, model, slots: int) -> tuple[tuple[Arg, ...], dict]:
    """The same for a row's `tokens`: one query per row, `slots` already `cache_slots`."""
    kv, dh = model.num_kv_heads, model.head_dim
    g, dt = model.num_heads // kv, model.compute_dtype
    return (Arg("q_NxKVxHgxDh", (rows, kv, g, dh), dt, True, False),
            Arg("pos_N", (rows,), "int32", True, False),
            Arg("row_N", (rows,), "int32", True, False),
            Arg("start_N", (rows,), "int32", True, False),
            Arg("k", (rows, kv, slots, dh), dt, True, False),
            Arg("v", (rows, kv, slots, dh), dt, True, False),
            Arg("key_mask_BxS", (rows, slots), "bool", True, False)), {
                "block": model.decode_block or 512}
