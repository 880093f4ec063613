"""Jitted, mesh-sharded sampling / score / update steps for one experiment config.

Letters: B responses, P prompt slots, S rollout slots, T = S − 1, L layers, K top-k.

Every step is jitted once with explicit `in_shardings` / `out_shardings` over the named
mesh: params and optimizer state by the logical rules of `sharding.py`, every batch
tensor split along its batch axis over the data-parallel mesh axes, and the train state
donated to the update.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from stablerl_jax import rollout as rollout_lib
from stablerl_jax import sharding
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl import steps


def make_optimizer(rl_cfg) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW: the usual LLM-RL optimizer."""
    return optax.chain(
        optax.clip_by_global_norm(rl_cfg.grad_clip),
        optax.adamw(rl_cfg.learning_rate, b1=rl_cfg.adam_b1, b2=rl_cfg.adam_b2,
                    eps=rl_cfg.adam_eps, weight_decay=rl_cfg.weight_decay))


def make_mesh(rl_cfg, devices=None):
    """The (data, fsdp, expert) mesh of rl.mesh over the first devices of `devices`
    (default: the default backend's)."""
    devices = jax.devices() if devices is None else list(devices)
    data, fsdp, expert = rl_cfg.mesh
    n = data * fsdp * expert
    if n > len(devices):
        raise ValueError(f"rl.mesh={rl_cfg.mesh} needs {n} devices, only {len(devices)} "
                         "are visible; shrink rl.mesh")
    return sharding.make_mesh(data, fsdp, expert, devices=devices[:n])


def batch_tree_shardings(mesh, tree):
    """Batch axis over the data-parallel mesh axes: axis 1 for [L, B, ...] routes, else 0."""
    def one(path, leaf):
        if leaf.ndim == 0:
            return sharding.replicated(mesh)
        if "routes" in jax.tree_util.keystr(path):
            return sharding.routes_sharding(mesh)
        return sharding.batch_sharding(mesh, leaf.ndim)
    return jax.tree_util.tree_map_with_path(one, tree)


class _ShardedJit:
    """jax.jit with explicit shardings computed from the first call's argument structure
    (batch dicts differ in keys between replay modes); one compiled step per structure."""

    def __init__(self, fn, shardings_for, donate_argnums=()):
        self.fn, self.shardings_for, self.donate = fn, shardings_for, donate_argnums
        self.compiled = {}

    def __call__(self, *args):
        key = jax.tree.structure(args)
        if key not in self.compiled:
            in_sh, out_sh = self.shardings_for(*args)
            self.compiled[key] = (in_sh, jax.jit(self.fn, in_shardings=in_sh,
                                                 out_shardings=out_sh,
                                                 donate_argnums=self.donate))
        in_sh, fn = self.compiled[key]
        # Place arguments on the mesh (a no-op for ones already sharded this way).
        return fn(*jax.device_put(args, in_sh))


@dataclasses.dataclass
class Engine:
    """The jitted steps of one experiment, bound to a mesh."""

    cfg: object            # ExperimentConfig
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    param_shardings: dict
    state_shardings: steps.TrainState

    @classmethod
    def create(cls, cfg, params_like=None, devices=None) -> "Engine":
        mesh = make_mesh(cfg.rl, devices)
        optimizer = make_optimizer(cfg.rl)
        shapes = params_like if params_like is not None else jax.eval_shape(
            lambda: tf.init_params(jax.random.key(0), cfg.model))
        p_sh = sharding.tree_shardings(tf.param_logical_axes(cfg.model), shapes, mesh)
        opt_shapes = jax.eval_shape(optimizer.init, shapes)
        rep = sharding.replicated(mesh)
        # Optimizer moments mirror the params they belong to; counts are replicated.
        opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, p_sh,
                                       transform_non_params=lambda _: rep)
        state_sh = steps.TrainState(p_sh, opt_sh, rep, rep)
        return cls(cfg, mesh, optimizer, p_sh, state_sh)

    def init_state(self, params) -> steps.TrainState:
        params = jax.device_put(params, self.param_shardings)
        init = jax.jit(lambda p: steps.TrainState(p, self.optimizer.init(p),
                                                  jnp.zeros((), jnp.int32),
                                                  jnp.zeros((), jnp.int32)),
                       out_shardings=self.state_shardings)
        return init(params)

    @functools.cached_property
    def sample(self):
        """(params, prompt_tokens_BxP, prompt_mask_BxP, key) -> Rollout (sampling engine)."""
        cfg = self.cfg

        def fn(params, prompts, mask, key):
            return rollout_lib.sample(params, prompts, mask, key, cfg.model, cfg.sampling,
                                      cfg.rl.numerics)

        def shardings_for(params, prompts, mask, key):
            b_sh = sharding.batch_sharding(self.mesh, 2)
            out = batch_tree_shardings(self.mesh, jax.eval_shape(fn, params, prompts, mask, key))
            return (self.param_shardings, b_sh, b_sh, sharding.replicated(self.mesh)), out

        return _ShardedJit(fn, shardings_for)

    @functools.cached_property
    def score(self):
        """(params, batch) -> {old_logp, entropy, routes_old}: the π_old pass."""
        rl = self.cfg.rl
        fn = functools.partial(steps.score, cfg=self.cfg.model, replay=rl.replay,
                               temperature=self.cfg.sampling.temperature, impl=rl.logprob_impl)

        def shardings_for(params, batch):
            out = batch_tree_shardings(self.mesh, jax.eval_shape(fn, params, batch))
            return (self.param_shardings, batch_tree_shardings(self.mesh, batch)), out

        return _ShardedJit(fn, shardings_for)

    @functools.cached_property
    def update(self):
        """(state, mini-batch) -> (state, metrics); the state is donated."""
        rl = self.cfg.rl
        fn = functools.partial(steps.update, cfg=self.cfg.model, loss_cfg=self.cfg.loss,
                               replay=rl.replay, optimizer=self.optimizer,
                               temperature=self.cfg.sampling.temperature, impl=rl.logprob_impl)

        def shardings_for(state, batch):
            rep = sharding.replicated(self.mesh)
            metrics = jax.tree.map(lambda _: rep, jax.eval_shape(fn, state, batch)[1])
            return ((self.state_shardings, batch_tree_shardings(self.mesh, batch)),
                    (self.state_shardings, metrics))

        return _ShardedJit(fn, shardings_for, donate_argnums=(0,))
