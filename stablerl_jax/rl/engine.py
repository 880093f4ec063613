"""The jitted, mesh-sharded steps of one experiment, built once in `Engine.create`.

Letters: B responses (rows), P prompt slots, M responses per mini-batch.

Shardings are explicit and fixed: params and optimizer state by the logical rules of
`sharding.py`, every batch leaf along axis 0 over the data-parallel axes (one `NamedSharding`, a
pytree prefix for whole Rollouts and TrainBatches), metrics replicated; the updates donate the
train state. Public methods place their arguments on these shardings (a no-op where already
there) and call the step. Memory knobs: `rl.microbatches` update slices (SFT: `sft.microbatches`;
the score step sliced alike), `sampling.max_batch` rows decoded at a time, `model.remat`,
`model.attention_impl`.

Devices may be abstract: `Engine.create(cfg, devices=topology.devices)` with the devices of
`jax.experimental.topologies.get_topology_desc` builds a TPU pod's steps on any host;
`Engine.lower(name, *args)` lowers one for `jax.ShapeDtypeStruct` arguments
(`Engine.abstract_inputs`; stablerl_jax/pod/aot.py compiles them and reads their memory).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stablerl_jax import distributed, sharding
from stablerl_jax.config import ExperimentConfig, OptimConfig, RLConfig
from stablerl_jax.data.batching import SFTBatch
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import aot
from stablerl_jax.rl import dynamic, inflight, probe, step_fns
from stablerl_jax.sampling import continuous
from stablerl_jax.sampling import rollout as rollout_lib


def lr_shape(optim: OptimConfig, total_steps: int):
    """The schedule of `optim` over `total_steps` at peak 1, or None for a constant rate."""
    warmup = int(optim.warmup_frac * total_steps)
    if optim.schedule == "cosine":
        warmup = max(warmup, 1)
        return optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup,
                                                  max(total_steps, warmup + 1),
                                                  end_value=optim.end_lr_frac)
    if warmup:
        return optax.join_schedules([optax.linear_schedule(0.0, 1.0, warmup),
                                     optax.constant_schedule(1.0)], [warmup])
    return None


def router_leaves(params):
    """The params tree with True at the router weights (layers.router), False elsewhere."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: [getattr(k, "key", None) for k in path] == ["layers", "router"], params)


def _clipped_adamw(learning_rate, optim: OptimConfig, total_steps: int,
                   freeze_router: bool = False):
    shape = lr_shape(optim, total_steps)
    lr = learning_rate if shape is None else (lambda n: learning_rate * shape(n))
    chain = [optax.clip_by_global_norm(optim.grad_clip),
             optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                         weight_decay=optim.weight_decay)]
    if freeze_router:
        # Zero the router's gradient before the clip (it adds nothing to the norm and its
        # moments stay 0) and its update after AdamW (whose weight decay would move it).
        frozen = optax.masked(optax.set_to_zero(), router_leaves)
        chain = [frozen, *chain, frozen]
    return optax.chain(*chain)


def make_optimizer(optim: OptimConfig, total_steps: int,
                   freeze_router: bool = False) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule of `optim` over `total_steps`;
    `freeze_router` (rl.freeze_router) leaves router weights and their optimizer state unchanged.
    The peak rate is optimizer state (`optax.inject_hyperparams`, a float32 scalar), so runs
    differing only in it share one compiled update (`program_optim`). A constant rate is exact; a
    schedule scales its peak-1 shape by the rate, which can round the last bit differently
    (docs/architecture.md, "Engine")."""
    return optax.inject_hyperparams(
        _clipped_adamw, static_args=("optim", "total_steps", "freeze_router"))(
        learning_rate=optim.learning_rate, optim=optim, total_steps=total_steps,
        freeze_router=freeze_router)


def program_optim(optim: OptimConfig, total_steps: int) -> tuple[OptimConfig, int]:
    """(optim, total_steps) with what the compiled steps do not depend on at defaults: the
    learning rate (optimizer state), and the step count where the rate is constant."""
    optim = optim.replace(learning_rate=OptimConfig().learning_rate)
    return optim, (total_steps if lr_shape(optim, total_steps) is not None else 0)


def param_shardings(cfg: ExperimentConfig, devices=None, params_like=None) -> dict:
    """`Engine.create`'s param shardings on `cfg.mesh`, to load checkpoints straight onto."""
    mesh = sharding.config_mesh(cfg.mesh, devices, cfg.mesh_dcn)
    shapes = params_like if params_like is not None else jax.eval_shape(
        lambda: tf.init_params(jax.random.key(0), cfg.model))
    return sharding.tree_shardings(tf.param_logical_axes(cfg.model), shapes, mesh)


@dataclasses.dataclass(frozen=True)
class Engine:
    """The steps of one experiment bound to a mesh and an optimizer."""

    cfg: ExperimentConfig
    learning_rate: float   # the optimizer's peak rate, set in its state by init_state
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    param_shardings: dict
    state_shardings: step_fns.TrainState
    batch_sharding: jax.sharding.NamedSharding
    _jitted: dict

    @classmethod
    def create(cls, cfg: ExperimentConfig, *, eos_id: int, pad_id: int, stop_ids=(),
               optim: OptimConfig | None = None, total_steps: int | None = None,
               devices=None, params_like=None) -> "Engine":
        """Mesh, shardings and jitted steps. eos_id / pad_id: the tokenizer's; the sampler also
        stops on `stop_ids` (generation_config.json's eos ids). optim / total_steps: default
        cfg.rl.optim over rl.steps × rl.num_minibatches updates (SFT: cfg.sft.optim, sft.steps).
        Configs differing only in fields no step reads (`LOOP_ONLY`: seed, step counts, cadences)
        share one set of jitted steps per process, so a variant's next seed compiles nothing."""
        for field in ("model.router_dtype", "sampling.router_dtype"):
            section, name = field.split(".")
            if getattr(getattr(cfg, section), name) == "float64" and not jax.config.jax_enable_x64:
                raise ValueError(f"{field}: 'float64' needs 64-bit JAX (without it the router "
                                 "would silently compute in float32); set JAX_ENABLE_X64=1 or "
                                 f"{field}=float32")
        if optim is None:
            optim, total_steps = cfg.rl.optim, cfg.rl.steps * cfg.rl.num_minibatches
        # The seed enters a step only as the seed of the sampler's router noise.
        noise_seed = cfg.rl.seed if cfg.sampling.router_noise_std > 0 else 0
        args = (program_config(cfg), rollout_lib.stop_set(eos_id, stop_ids), pad_id,
                *program_optim(optim, total_steps), noise_seed,
                None if devices is None else tuple(devices))
        if params_like is None:
            return cls(cfg, optim.learning_rate, *_shared_steps(*args))
        return cls(cfg, optim.learning_rate, *_steps(*args, params_like))

    def _place(self, name: str, args, leaf):
        """(step, args with each leaf mapped by leaf(x, its input sharding))."""
        fn, in_shardings = self._jitted[name]
        is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
        place = lambda sh, sub: jax.tree.map(lambda x: leaf(x, sh), sub)
        return fn, jax.tree.map(place, in_shardings, args, is_leaf=is_sharding)

    def _call(self, name: str, *args):
        """Step `name` on its arguments placed on its input shardings (distributed.to_global:
        multi-process, a host batch argument is this process's rows, others full copies)."""
        fn, placed = self._place(name, args, lambda x, sh: distributed.to_global(
            x, sh, batch=sh is self.batch_sharding))
        return fn(*placed)

    @classmethod
    def for_topology(cls, cfg: ExperimentConfig, topo: aot.Topology, *, eos_id: int = 1,
                     pad_id: int = 0) -> "Engine":
        """The Engine of `cfg` on a TPU topology's abstract devices (aot.mesh_devices), for an
        AOT compile; the special ids only matter to the sampler."""
        return cls.create(cfg, eos_id=eos_id, pad_id=pad_id,
                          devices=aot.mesh_devices(cfg, topo))

    def abstract_inputs(self, name: str) -> tuple:
        """ShapeDtypeStructs of step `name`'s arguments ("sample", "score", "update",
        "sft_update") for `lower`: B rows for sample and score, M for updates."""
        cfg = self.cfg
        rl, mc = cfg.rl, cfg.model
        b = rl.prompts_per_step * rl.group_size
        p = cfg.task.max_prompt_len
        s = p + cfg.sampling.max_new_tokens
        sds = jax.ShapeDtypeStruct
        params = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), mc))
        if name == "sample":
            key = jax.eval_shape(lambda: jax.random.key(0))
            return (params, sds((b, p), jnp.int32), sds((b, p), jnp.bool_), key)
        if name == "score":
            rollout = rollout_lib.Rollout(
                sds((b, s), jnp.int32), sds((b, s), jnp.bool_), sds((b, s), jnp.bool_),
                sds((b,), jnp.int32), sds((b, s), jnp.float32),
                sds((b, s, mc.num_layers, mc.top_k), jnp.int32),
                truncated_B=sds((b,), jnp.bool_))
            return (params, rollout, sds((b,), jnp.float32))
        state = jax.eval_shape(self._jitted["init_state"][0], params,
                               sds((), jnp.float32))
        if name == "update":
            m, t = b // rl.num_minibatches, s - 1
            replay = None if rl.replay == "none" else sds((m, t, mc.num_layers, mc.top_k),
                                                          jnp.int32)
            batch = step_fns.TrainBatch(sds((m, s), jnp.int32), sds((m, s), jnp.bool_),
                                     sds((m, t), jnp.float32), sds((m, t), jnp.float32),
                                     sds((m, t), jnp.float32), sds((m,), jnp.float32), replay)
            return (state, batch)
        if name == "sft_update":
            m, s = cfg.sft.batch_size, p + cfg.task.max_solution_len + 1
            return (state, SFTBatch(sds((m, s), jnp.int32), sds((m, s), jnp.bool_),
                                    sds((m, s - 1), jnp.float32)))
        raise ValueError(f"step {name!r}: one of sample, score, update, sft_update")

    def lower(self, name: str, *args):
        """`jax.stages.Lowered` of step `name` for `args` (arrays or ShapeDtypeStructs, e.g.
        `abstract_inputs(name)`) on its input shardings; `.compile()` gives its program."""
        fn, abstract = self._place(name, args, lambda a, sh: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=sh))
        return fn.lower(*abstract)

    def init_state(self, params) -> step_fns.TrainState:
        """Fresh TrainState of `params`: optimizer state at this rate, zero counters."""
        return self._call("init_state", params, np.float32(self.learning_rate))

    def with_learning_rate(self, state: step_fns.TrainState) -> step_fns.TrainState:
        """`state` (e.g. restored from a checkpoint) at this engine's learning rate."""
        rate = np.float32(self.learning_rate)
        return self._call("set_learning_rate", state, rate)

    def sample(self, params, prompts_BxP, mask_BxP, key) -> rollout_lib.Rollout:
        """The sampling engine on left-padded prompts (rollout.sample)."""
        return self._call("sample", params, prompts_BxP, mask_BxP, key)[0]

    def sample_counted(self, params, prompts_BxP, mask_BxP, key):
        """`sample` plus its decode steps as a device scalar (rl/costs.py's decode steps / s)."""
        return self._call("sample", params, prompts_BxP, mask_BxP, key)

    def trim(self, rollout: rollout_lib.Rollout, bucket: int) -> rollout_lib.Rollout:
        """The rollout cut to its used slots, width a multiple of `bucket` (rl.trim_bucket)."""
        fn, (placed,) = self._place("used_slots", (rollout,), lambda x, sh: (
            distributed.to_global(x, sh, batch=True)))
        lo, hi = rollout_lib.used_window(distributed.host(fn(placed)), bucket)
        if (lo, hi) == (0, placed.tokens_BxS.shape[1]):
            return placed
        return self._jitted["trim"][0](placed, lo, hi)

    def score(self, params, rollout: rollout_lib.Rollout, rewards_B, age_BxS=None):
        """(TrainBatch, monitor pairs): the π_old pass (step_fns.score; rl.score_in_update: no
        forward, the update returns the monitors). With `age_BxS` (rl.old_policy=behavior),
        `params` is the tuple of versions and each token scores at params[its age]."""
        if age_BxS is None:
            return self._call("score", params, rollout, rewards_B)
        return self._call("score_behavior", tuple(params), rollout, rewards_B, age_BxS)

    def sample_partial(self, params, queue, version: int):
        """(queue, decode steps): the continuous sampler on the carried queue until
        rl.prompts_per_step groups are complete (rl/inflight.py)."""
        return self._call("sample_partial", params, queue, version)

    def probe(self, params, rollout: rollout_lib.Rollout, batch: step_fns.TrainBatch,
              age_BxS=None) -> dict:
        """rl/probe.py probe_rows of a rollout's rows and its batch, on the host (with `age_BxS`,
        `params` is the tuple of versions of rl.old_policy=behavior)."""
        found = (self._call("probe", params, rollout, batch) if age_BxS is None else
                 self._call("probe_behavior", tuple(params), rollout, batch, age_BxS))
        return jax.tree.map(distributed.host, found)

    def logp_rows(self, params, batch: step_fns.TrainBatch) -> np.ndarray:
        """log π_θ of the batch's rows as the update computes it (rl/probe.py), host."""
        return distributed.host(self._call("logp_rows", params, batch))

    def merge_rows(self, base: rollout_lib.Rollout, new: rollout_lib.Rollout, src_B, real_B
                   ) -> rollout_lib.Rollout:
        """rl/dynamic.py merge_rows: `new`'s rows where src_B >= 0, rows not real_B emptied."""
        return self._call("merge_rows", base, new, src_B, real_B)

    def row_tokens(self, batch: step_fns.TrainBatch) -> np.ndarray:
        """Each row's real tokens (prompt + completion), on the host of every process."""
        return distributed.host(self._call("row_tokens", batch))

    def select(self, batch, rows_M):
        """The rows `rows_M` of every leaf of a batch (a mini-batch)."""
        return self._call("select", batch, rows_M)

    def update(self, state: step_fns.TrainState, batch: step_fns.TrainBatch):
        """One RL optimizer step on a mini-batch; `state` is donated."""
        return self._call("update", state, batch)

    def sft_update(self, state: step_fns.TrainState, batch: step_fns.SFTBatch):
        """One supervised optimizer step; `state` is donated."""
        return self._call("sft_update", state, batch)


# RLConfig fields only the loop and the sources read (rl/loop.py, rl/sources.py); no jitted
# step depends on them (the eval batch is padded to the mesh and sampler multiple, the
# overlong penalty is added to the rewards on the host, so rl.overlong=penalty builds the
# steps of 'keep'; the trim bucket is the trim program's argument; the partial source
# chooses the score step of its old policy). tests/rl/step_fns_test.py checks the list
# against what building and tracing the steps reads.
LOOP_ONLY = ("steps", "eval_every", "checkpoint_every", "keep_checkpoints",
             "async_checkpoints", "phase_sync", "max_consecutive_skips", "seed",
             "offline_rollouts", "eval_k", "eval_problems", "overlong_buffer",
             "overlong_penalty_factor", "log_samples", "log_samples_every", "eval_sets",
             "dynamic_sampling", "max_sampling_rounds", "attribution_every",
             "attribution_rows", "trim_bucket", "old_policy")


def program_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with the name, `LOOP_ONLY` fields and learning rates at defaults: what the jitted
    steps are built from (Engine.create passes the noise seed and the optimizer apart)."""
    default = RLConfig()
    rate = OptimConfig().learning_rate
    overlong = "keep" if cfg.rl.overlong == "penalty" else cfg.rl.overlong
    rl = cfg.rl.replace(**{f: getattr(default, f) for f in LOOP_ONLY}, overlong=overlong,
                        optim=cfg.rl.optim.replace(learning_rate=rate))
    return cfg.replace(name="", rl=rl, sft=cfg.sft.replace(
        optim=cfg.sft.optim.replace(learning_rate=rate)))


def _steps(cfg: ExperimentConfig, stops: tuple, pad_id: int, optim: OptimConfig,
           total_steps: int, noise_seed: int, devices, params_like=None):
    """(mesh, optimizer, param / state / batch shardings, jitted steps) of Engine.create."""
    mesh = sharding.config_mesh(cfg.mesh, devices, cfg.mesh_dcn)
    optimizer = make_optimizer(optim, total_steps, cfg.rl.freeze_router)
    shapes = params_like if params_like is not None else jax.eval_shape(
        lambda: tf.init_params(jax.random.key(0), cfg.model))
    p_sh = param_shardings(cfg, devices, shapes)
    rep = sharding.replicated(mesh)
    # Optimizer moments mirror the params they belong to; counts are replicated.
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s,
                                   jax.eval_shape(optimizer.init, shapes), p_sh,
                                   transform_non_params=lambda _: rep)
    state_sh = step_fns.TrainState(p_sh, opt_sh, rep, rep)
    batch = sharding.batch_sharding(mesh)
    numerics = nx.of_sampling(cfg.sampling, noise_seed)
    # The expert FFN shards itself (shard_map) only where there is more than one device.
    model_mesh = mesh if mesh.size > 1 else None

    sample_model = rollout_lib.sampler_model(cfg.model, cfg.sampling)

    def sample(params, prompts_BxP, mask_BxP, key):
        """(Rollout, decode steps): the static sampler runs each pass to its longest response
        (rollout.py stops when every row has), the continuous one counts its steps."""
        kw = dict(eos_id=-1, stop_ids=stops, pad_id=pad_id, mesh=model_mesh,
                  logprob_impl=cfg.rl.logprob_impl)
        if cfg.sampling.continuous:
            return continuous.sample(params, prompts_BxP, mask_BxP, key, sample_model,
                                     cfg.sampling, numerics, with_steps=True, **kw)
        out = rollout_lib.sample(params, prompts_BxP, mask_BxP, key, sample_model,
                                 cfg.sampling, numerics, **kw)
        return out, rollout_lib.decode_steps(out.lengths_B, cfg.sampling.max_batch)

    def sample_partial(params, queue, version):
        return continuous.run(params, queue, version, cfg=sample_model,
                              sampling=cfg.sampling, numerics=numerics, stops=stops,
                              pad_id=pad_id, mesh=model_mesh,
                              logprob_impl=cfg.rl.logprob_impl,
                              need_groups=cfg.rl.prompts_per_step,
                              group_size=cfg.rl.group_size,
                              slots=inflight.slots(cfg))

    def set_learning_rate(state, rate):
        hyper = dict(state.opt_state.hyperparams)
        hyper["learning_rate"] = rate.astype(hyper["learning_rate"].dtype)
        return state._replace(opt_state=state.opt_state._replace(hyperparams=hyper))

    def init_state(params, rate):
        zero = jnp.zeros((), jnp.int32)
        return set_learning_rate(step_fns.TrainState(params, optimizer.init(params), zero, zero),
                                 rate)

    def update(loss_fn, microbatches, state, batch_, pack=None):
        return step_fns.apply_gradients(
            state, functools.partial(loss_fn, cfg=cfg, mesh=model_mesh), batch_,
            optimizer, microbatches, pack)

    pack = ((cfg.rl.pack_tokens, step_fns.batch_shards(cfg), cfg.rl.pack_rows)
            if cfg.rl.pack_tokens else None)

    score_slices = cfg.rl.num_minibatches * cfg.rl.microbatches
    onpolicy_fused = cfg.rl.score_in_update and cfg.rl.num_minibatches == 1
    jitted = {
        "init_state": (jax.jit(init_state, out_shardings=state_sh), (p_sh, rep)),
        "set_learning_rate": (jax.jit(set_learning_rate, out_shardings=state_sh),
                              (state_sh, rep)),
        "sample": (jax.jit(sample, out_shardings=(batch, rep)), (p_sh, batch, batch, rep)),
        "score": (jax.jit(functools.partial(step_fns.score, cfg=cfg, n_slices=score_slices,
                                            mesh=model_mesh,
                                            forward=not onpolicy_fused),
                          out_shardings=(batch, rep)), (p_sh, batch, batch)),
        "sample_partial": (jax.jit(sample_partial, out_shardings=(batch, rep)),
                           (p_sh, batch, rep)),
        # rl.old_policy=behavior: params of the last S + 1 versions, each token's age.
        "score_behavior": (jax.jit(lambda ps, r, rw, age: step_fns.score(
            ps, r, rw, cfg=cfg, n_slices=score_slices, mesh=model_mesh, age_BxS=age),
            out_shardings=(batch, rep)),
            ((p_sh,) * (cfg.rl.max_staleness + 1), batch, batch, batch)),
        "probe": (jax.jit(functools.partial(probe.probe_rows, cfg=cfg, mesh=model_mesh),
                          out_shardings=rep), (p_sh, batch, batch)),
        "probe_behavior": (jax.jit(lambda ps, r, b, age: probe.probe_rows(
            ps, r, b, age, cfg=cfg, mesh=model_mesh), out_shardings=rep),
            ((p_sh,) * (cfg.rl.max_staleness + 1), batch, batch, batch)),
        "logp_rows": (jax.jit(functools.partial(probe.logp_rows, cfg=cfg, mesh=model_mesh),
                              out_shardings=rep), (p_sh, batch)),
        "merge_rows": (jax.jit(functools.partial(dynamic.merge_rows, pad_id=pad_id),
                               out_shardings=batch), (batch, batch, rep, rep)),
        "select": (jax.jit(lambda b, rows: jax.tree.map(lambda x: x[rows], b),
                           out_shardings=batch), (batch, rep)),
        "used_slots": (jax.jit(lambda r: jnp.any(r.prompt_mask_BxS | r.completion_mask_BxS,
                                                 axis=0), out_shardings=rep), (batch,)),
        "row_tokens": (jax.jit(lambda b: jnp.sum(b.attn_BxS, axis=1, dtype=jnp.int32),
                               out_shardings=rep), (batch,)),
        "trim": (jax.jit(rollout_lib.trim, static_argnums=(1, 2), out_shardings=batch),
                 (batch,)),
        "update": (jax.jit(functools.partial(update, step_fns.rl_loss, cfg.rl.microbatches,
                                             pack=pack),
                           donate_argnums=0, out_shardings=(state_sh, rep)),
                   (state_sh, batch)),
        "sft_update": (jax.jit(functools.partial(update, step_fns.sft_loss,
                                                 cfg.sft.microbatches),
                               donate_argnums=0, out_shardings=(state_sh, rep)),
                       (state_sh, batch)),
    }
    return mesh, optimizer, p_sh, state_sh, batch, jitted


_shared_steps = functools.lru_cache(maxsize=16)(_steps)


def release_programs() -> None:
    """Drop the Engines' shared steps and every compiled program of this process.

    Each executable holds a few memory mappings of its machine code. A process that runs
    many configurations (an experiment's variants) would keep them all: about 4,700
    mappings per stabilizers variant, so that near the kernel's default limit
    (vm.max_map_count = 65,530) a compile fails with "LLVM compilation error: Cannot
    allocate memory" and the process aborts. Arrays are kept; the next call compiles again
    (or loads from the persistent compilation cache)."""
    _shared_steps.cache_clear()
    jax.clear_caches()
