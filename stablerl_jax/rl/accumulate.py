"""Micro-batching: a mini-batch's loss, metrics and gradient as a sum over n micro-batches of its
B rows, in one jitted step.

Micro-batch i holds the strided rows i, i + n, i + 2n, … (`slices.split`): each spans the whole
mesh, so cutting moves no data between devices. Each slice's loss uses the mini-batch's
denominators (`losses.Totals`: B, Σ mask, non-empty rows), so loss(batch) = Σ_i loss_i and
∇loss(batch) = Σ_i ∇loss_i in exact arithmetic under every aggregation. Metrics are (num, den)
pairs: sums add, `*_max` / `*_min` take the max / min over the slices that counted anything
(`diagnostics.combine_pairs`, as `reduce_metrics` over mini-batches). The scan carries one
gradient accumulator (float32 or wider): one micro-batch's activation memory, one optimizer step
per mini-batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stablerl_jax import slices
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.model.numerics import accum_dtype


def value_and_grad(loss_fn, params, batch, n: int):
    """((loss, metrics), grads) of `loss_fn(params, micro_batch) -> (loss, metrics)` summed over
    the n micro-batches of `batch` (`lax.scan`); `loss_fn` uses mini-batch totals."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accum_dtype(p.dtype)), params)

    def body(grads, part):
        (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, part)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), (loss, metrics)

    grads, (losses_n, metrics_n) = jax.lax.scan(body, zeros,
                                                   slices.split(batch, n, "micro-batches"))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (jnp.sum(losses_n), dg.combine_pairs(metrics_n)), grads


def packed_value_and_grad(loss_fn, params, count: int, used):
    """As `value_and_grad`, `loss_fn(params, i) -> (loss, metrics)` over a packed mini-batch's
    micro-batches i < `used` (stablerl_jax/packing.py): a scan over all `count` whose `lax.cond`
    skips the empty rest (no cost, every pair (0, 0))."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accum_dtype(p.dtype)), params)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    out_shape = jax.eval_shape(grad_fn, params, 0)[0]

    def run(grads, i):
        (loss, metrics), g = grad_fn(params, i)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), (loss, metrics)

    def skip(grads, i):
        return grads, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

    def body(grads, i):
        return jax.lax.cond(i < used, run, skip, grads, i)

    grads, (losses_n, metrics_n) = jax.lax.scan(body, zeros, jnp.arange(count))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (jnp.sum(losses_n), dg.combine_pairs(metrics_n)), grads
