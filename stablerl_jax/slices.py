"""Strided row slices of a batch: how micro-batches and sampler slices are cut.

Letters: B rows, n slices, B/n rows per slice.

Slice i holds rows i, i + n, i + 2n, … of every leaf. Batch leaves are sharded along
axis 0 in contiguous blocks (sharding.batch_sharding), so when B/n is a multiple of the
device count each device keeps its own rows and every slice is spread over the whole
mesh: cutting slices moves no data between devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def split(tree, n: int, what: str = "slices"):
    """Every leaf [B, ...] -> [n, B/n, ...], slice i = rows i, i+n, i+2n, …"""
    def one(x):
        if x.shape[0] % n:
            raise ValueError(f"{what}: {n} slices must divide the batch of {x.shape[0]} "
                             "rows")
        return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)
    return jax.tree.map(one, tree)


def unsplit(tree):
    """Inverse of `split`: every leaf [n, B/n, ...] -> [B, ...] in the original row order."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:]), tree)


def map_slices(fn, tree, n: int, what: str = "slices"):
    """fn over n strided slices of every leaf's rows, results reassembled in row order
    (`lax.map`: one slice's memory at a time); n = 1 calls fn directly."""
    if n == 1:
        return fn(tree)
    return unsplit(jax.lax.map(fn, split(tree, n, what)))
