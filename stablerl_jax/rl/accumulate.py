"""Micro-batching: a mini-batch's loss, metrics and gradient as a sum over slices of it,
inside one jitted step.

Letters: B rows of the mini-batch, n micro-batches, B/n rows per micro-batch.

A mini-batch is split into n micro-batches by strided rows (`slices.split`: micro-batch
i holds rows i, i + n, i + 2n, …, so every micro-batch is spread over the whole mesh and
cutting them moves no data between devices).

Exactness. Each slice's loss is written with the mini-batch's denominators
(`losses.Totals`: its B, Σ mask and non-empty rows, passed in by the caller), so

    loss(batch) = Σ_i loss_i,      ∇loss(batch) = Σ_i ∇loss_i

in exact arithmetic under every aggregation (token-mean divides each slice's token sum by
the mini-batch's token count, not the slice's). Metrics are (num, den) pairs: sums add,
`*_max` / `*_min` pairs take the max / min over the slices that counted anything
(`diagnostics.combine_pairs`, the rule `reduce_metrics` applies to mini-batches). The scan
carries one gradient accumulator (float32 or wider), so activation memory is that of one
micro-batch while the optimizer still takes one step per mini-batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stablerl_jax import slices
from stablerl_jax.method import diagnostics as dg
from stablerl_jax.model.numerics import accum_dtype


def value_and_grad(loss_fn, params, batch, n: int):
    """((loss, metrics), grads) of `loss_fn(params, micro_batch) -> (loss, metrics)`
    summed over the n micro-batches of `batch` (a `lax.scan`; module docstring).
    `loss_fn` must already normalize by the whole mini-batch (losses.Totals)."""
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, accum_dtype(p.dtype)), params)

    def body(grads, part):
        (loss, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, part)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), (loss, metrics)

    grads, (losses_n, metrics_n) = jax.lax.scan(body, zeros,
                                                   slices.split(batch, n, "micro-batches"))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return (jnp.sum(losses_n), dg.combine_pairs(metrics_n)), grads


def packed_value_and_grad(loss_fn, params, count: int, used):
    """((loss, metrics), grads) of `loss_fn(params, i) -> (loss, metrics)` summed over the
    micro-batches i < `used` of a packed mini-batch (stablerl_jax/packing.py): a scan over
    all `count` of them whose body is a `lax.cond`, so the micro-batches no shard has
    rows in cost nothing (their metrics count nothing: every pair is (0, 0))."""
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
