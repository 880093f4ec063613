"""What a decoder layer reads besides its carry and parameters: two records shared by
transformer.decoder_layer and its batch-invariant twin (invariant_layer.decoder_layer), built
once per call by transformer.forward."""
from __future__ import annotations

from typing import NamedTuple

import jax

from stablerl_jax.model import numerics as nx


class TokenFrame(NamedTuple):
    """This call's tokens as every layer reads them. One pytree, because a custom VJP may not
    close over traced arrays: the batch-invariant layer takes it as an argument."""

    positions_BxT: jax.Array
    key_mask_BxS: jax.Array  # the keys a query may attend to (the cache's slots, or T)
    slots_T: jax.Array       # the slots this call's tokens take ([T], or [B, T])
    mask_BxT: jax.Array
    tokens_BxT: jax.Array
    segment_ids_BxT: jax.Array | None  # packed rows; None: one sequence a row


class LayerNumerics(NamedTuple):
    """How a layer computes. `router_input(x, scale)`: the router's own normalized input (None:
    the rounded hidden state); `index`: the cache index (None: no cache); `trace`: also output
    the residual streams (transformer.forward's aux["trace"])."""

    numerics: nx.Numerics
    dtype: object
    router_dtype: object
    router_input: object
    index: jax.Array | None
    trace: bool
