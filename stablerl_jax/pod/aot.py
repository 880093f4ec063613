"""Ahead-of-time compilation for a TPU pod from any host: topology names, abstract step inputs,
per-chip memory, FLOPs and collectives of the compiled programs.

Letters: B responses of a step, M responses of a mini-batch, P prompt slots, C completion slots,
S = P + C slots, T = S − 1, L layers, K top-k.

`jax.experimental.topologies.get_topology_desc` (with libtpu: `pip install -e '.[tpu]'`) gives a
TPU slice's devices with no TPU attached; an `Engine` on them (`Engine.create(devices=...)`) has
the project's mesh, shardings and jitted steps, and `Engine.lower(...).compile()` is the XLA TPU
compiler's program for that pod. Its `memory_analysis()` gives per-chip bytes:

    argument   inputs resident in HBM (params, optimizer state, batch)
    output     outputs not aliased to a donated input
    temp       the peak of everything else the program allocates
    total      argument + output + temp − alias  (what must fit in the chip's HBM)

Names are Cloud TPU's (as in MaxText): `v5p-N` / `v4-N` count TensorCores (two per chip: v5p-256
is 128 chips, a 4x4x8 torus), `v5e-N` / `v6e-N` chips. `KxNAME` (`2xv5p-128`) is K slices joined
by the data-center network (DCN): `get_topology_desc(..., num_slices=K)` devices carry a
`slice_index`, `mesh_dcn` (config) names the mesh axes crossing slices (sharding.make_mesh), and
the compiled program is one slice's, its DCN traffic the cross-slice transfers (hlo_loops.py)."""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp

from stablerl_jax import sharding
from stablerl_jax.config import ExperimentConfig
from stablerl_jax.kernels.decode_attention_impls import (
    DECODE_IMPLS,
    decode_example_args,
    tokens_example_args,
)
from stablerl_jax.kernels.decode_attention_pallas import cache_slots
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS, logprob_example_args
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, gmm_example_args
from stablerl_jax.model.flops import forward_flops, train_flops
from stablerl_jax.pod import hlo_loops, sampler_programs
from stablerl_jax.pod.libtpu_env import quiet_libtpu

GIB = 2**30
# name: (JAX topology prefix, TensorCores per chip, torus dims, HBM GiB per chip).
# HBM: v5p 95.74 GiB and v5e 15.75 GiB are what the chips report as usable; v4 and v6e
# are their nominal 32 GiB.
CHIPS = {"v4": ("v4", 2, 3, 32.0), "v5p": ("v5p", 2, 3, 95.74), "v5e": ("v5e", 1, 2, 15.75),
         "v6e": ("v6e", 1, 2, 32.0)}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str          # e.g. "v5p-256", or "2xv5p-128" for two slices
    jax_name: str      # one slice's, e.g. "v5p:4x4x8"
    chips: int         # over all slices
    hbm_gib: float     # per chip
    slices: int = 1


def topology(name: str, slices: int | None = None) -> Topology:
    """A slice named like `v5p-256`, `v5e-8`, `v6e-64`, or `slices` of them (or `2xv5p-128`)."""
    m = re.fullmatch(r"(?:(\d+)x)?(v4|v5p|v5e|v6e)-(\d+)", name)
    if not m:
        raise ValueError(f"topology {name!r}: expected [<slices>x]<version>-<size> with "
                         f"version in {sorted(CHIPS)}, e.g. v5p-256, v5e-8 or 2xv5p-128")
    named = int(m.group(1)) if m.group(1) else None
    if named is not None and slices is not None and named != slices:
        raise ValueError(f"topology {name!r} names {named} slices but --num-slices is "
                         f"{slices}; give the count once")
    k = named if named is not None else 1 if slices is None else slices
    if k < 1:
        raise ValueError(f"topology {name!r}: the number of slices must be >= 1, got {k}")
    version, size = m.group(2), int(m.group(3))
    prefix, cores, ndim, hbm = CHIPS[version]
    chips = size // cores
    if chips < 1 or size % cores or chips & (chips - 1):
        raise ValueError(f"topology {name!r}: {version} sizes are powers of two "
                         f"(counting {'TensorCores, 2 per chip' if cores == 2 else 'chips'})")
    e = chips.bit_length() - 1
    if ndim == 2:
        dims = (2 ** (e // 2), 2 ** (e - e // 2))
    elif chips == 4:  # a single host: 2x2x1
        dims = (2, 2, 1)
    else:
        dims = tuple(2 ** (e // 3 + (i >= 3 - e % 3)) for i in range(3))
    one = f"{version}-{size}"
    return Topology(f"{k}x{one}" if k > 1 else one,
                    f"{prefix}:{'x'.join(map(str, dims))}", k * chips, hbm, k)


def devices(topo: Topology) -> list:
    """The (abstract) TPU devices of `topo`, every slice's (each has a `slice_index`)."""
    from jax.experimental import topologies
    quiet_libtpu()  # no TPU here: describe one without looking for hardware
    return list(topologies.get_topology_desc(topology_name=topo.jax_name, platform="tpu",
                                             num_slices=topo.slices).devices)


def mesh_devices(cfg: ExperimentConfig, topo: Topology) -> list:
    """`devices(topo)`, once `cfg`'s mesh is checked against the topology: its chips and
    its slices (Engine.for_topology builds the Engine on them)."""
    n = math.prod(cfg.mesh)
    if n != topo.chips:
        raise ValueError(f"mesh={cfg.mesh} has {n} devices but {topo.name} has {topo.chips} "
                         "chips; override mesh=data,fsdp,expert to match")
    if math.prod(cfg.mesh_dcn) != topo.slices:
        raise ValueError(f"mesh_dcn={cfg.mesh_dcn} spans {math.prod(cfg.mesh_dcn)} slice(s) "
                         f"but {topo.name} has {topo.slices}; override mesh_dcn (e.g. "
                         f"mesh_dcn={topo.slices},1,1: the data axis across the slices)")
    return devices(topo)


_COLLECTIVES = hlo_loops.COLLECTIVES


def collectives(hlo_text: str) -> dict:
    """Collective instructions in an optimized HLO module, by kind (an async pair counts
    once; an instruction inside a loop body counts once, however often it runs)."""
    ops = re.findall(r"\s(all-gather|all-to-all|ragged-all-to-all|reduce-scatter|"
                     r"all-reduce|collective-permute)(?:-start)?\(", hlo_text)
    return {k: sum(o == k or o == "ragged-" + k for o in ops) for k in _COLLECTIVES}


@dataclasses.dataclass
class Compiled:
    """What one AOT compile of a step says about one chip."""

    step: str
    argument_gib: float
    output_gib: float
    temp_gib: float
    alias_gib: float
    compile_s: float
    flops: float
    collectives: dict
    model_flops: float = math.nan  # per chip, model/flops.py (loops counted in full)
    hlo: str = dataclasses.field(repr=False, default="")
    # The slice of each device of the program's mesh, in its flat order (the device ids
    # of the HLO's replica groups; sharding.slice_indices); () when unknown.
    slices: tuple = dataclasses.field(repr=False, default=())

    @property
    def total_gib(self) -> float:
        return self.argument_gib + self.output_gib + self.temp_gib - self.alias_gib


def compile_lowered(step: str, lower) -> Compiled:
    """Compile `lower()` (a function returning a jax.stages.Lowered) and read it."""
    t0 = time.perf_counter()
    compiled = lower().compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    return Compiled(step, mem.argument_size_in_bytes / GIB, mem.output_size_in_bytes / GIB,
                    mem.temp_size_in_bytes / GIB, mem.alias_size_in_bytes / GIB, seconds,
                    float(cost.get("flops", math.nan)), collectives(hlo), hlo=hlo)


def score_forwards(cfg) -> int:
    """Score-step forwards: one for π_old, none where the on-policy update scores in its own
    forward (rl.score_in_update, one mini-batch); one more for rl.attribution's θ_old term."""
    fused = cfg.rl.score_in_update and cfg.rl.num_minibatches == 1
    return (0 if fused else 1) + (1 if cfg.rl.attribution else 0)


def step_model_flops(cfg: ExperimentConfig, name: str) -> float:
    """Model FLOPs per chip of one call of step `name` (model/flops.py): sampler, one forward
    over every slot (an upper bound: rows stopping early do less); score, its score_forwards;
    updates, forward + backward of their batch (remat forwards are not model FLOPs)."""
    rl, mc = cfg.rl, cfg.model
    b = rl.prompts_per_step * rl.group_size
    s = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    flops = {"sample": lambda: forward_flops(mc, b, s),
             "score": lambda: forward_flops(mc, b, s - 1) * score_forwards(cfg),
             "update": lambda: train_flops(mc, b // rl.num_minibatches, s - 1),
             "sft_update": lambda: train_flops(mc, cfg.sft.batch_size,
                                               cfg.task.max_prompt_len
                                               + cfg.task.max_solution_len)}[name]()
    return flops / math.prod(cfg.mesh)


def compile_step(engine, name: str) -> Compiled:
    """AOT-compile Engine step `name` at its config's batch sizes (Engine.abstract_inputs)."""
    args = engine.abstract_inputs(name)
    out = compile_lowered(name, lambda: engine.lower(name, *args))
    out.model_flops = step_model_flops(engine.cfg, name)
    out.slices = sharding.slice_indices(engine.mesh)
    return out


def kernel_programs(cfg: ExperimentConfig, devices_: list) -> list[tuple[str, object, tuple]]:
    """(label, program, abstract args) per TPU Pallas kernel of LOGPROB_IMPLS, GMM_IMPLS and
    DECODE_IMPLS (rows with `pallas` and "tpu" among their backends), at its op's example shapes
    (`*_example_args`): update kernels at one micro-batch's tokens per chip, forward + backward
    in shard_map over the config's mesh on `devices_` (cotangents as arguments, replicated
    arguments' gradients psummed, as in the update); decode attention forward only, the
    sampler's rows per chip against the whole cache, and its per-token kernel (`tokens`,
    batch-invariant numerics) at one query per row. Lowered only (`compile_kernels` compiles)."""
    mesh = sharding.config_mesh(cfg.mesh, devices_, cfg.mesh_dcn)
    axes = sharding.RULES["batch"]
    mc, rl = cfg.model, cfg.rl
    rows = rl.prompts_per_step * rl.group_size // rl.num_minibatches // rl.microbatches
    t = max(rows // mesh.size, 1) * (cfg.task.max_prompt_len + cfg.sampling.max_new_tokens - 1)
    decode_rows = max(sampler_programs.rows_per_pass(cfg) // mesh.size, 1)
    slots = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
    tokens = {name: row.tokens for name, row in DECODE_IMPLS.items() if row.tokens is not None}
    ops = (("logprob", LOGPROB_IMPLS,
            logprob_example_args(t, mc.d_model, mc.vocab_size, mc.compute_dtype)),
           ("gmm", GMM_IMPLS, gmm_example_args(t, mc)),
           ("decode_attention", DECODE_IMPLS, decode_example_args(decode_rows, mc, slots)),
           ("decode_attention tokens", tokens, tokens_example_args(
               decode_rows, mc, cache_slots(slots, mc.decode_block or 512))))
    label = lambda op, args: f"{op} {{}} {'fwd+bwd' if any(a.diff for a in args) else 'fwd'}"
    return [(label(op, args).format(name), *_fwd_bwd_program(row.load(), args, static, mesh,
                                                             axes))
            for op, table, (args, static) in ops
            for name, row in table.items() if row.pallas and "tpu" in row.backends]


def _fwd_bwd_program(fn, args, static: dict, mesh, axes) -> tuple:
    """(jitted shard_map program, its global abstract arguments): the `args` (kernels.Arg, per
    device), then one cotangent per output; it returns (outputs, gradients of the `diff`
    arguments, replicated ones psummed), or (outputs,) with no `diff` argument."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    split, rep = P(axes), P()
    n = mesh.size
    local = [jax.ShapeDtypeStruct(a.shape, jnp.dtype(a.dtype)) for a in args]
    outs = jax.eval_shape(lambda *xs: fn(*xs, **static), *local)
    diff = [i for i, a in enumerate(args) if a.diff]
    cots = jax.tree.leaves(outs) if diff else []

    def program(*xs):
        inputs, cot = list(xs[:len(args)]), xs[len(args):]
        if not diff:
            return (fn(*inputs, **static),)

        def f(*d):
            full = list(inputs)
            for i, v in zip(diff, d):
                full[i] = v
            return fn(*full, **static)

        out, vjp = jax.vjp(f, *(inputs[i] for i in diff))
        grads = vjp(jax.tree.unflatten(jax.tree.structure(outs), cot))
        return out, tuple(g if args[i].split else jax.lax.psum(g, axes)
                          for i, g in zip(diff, grads))

    specs = [split if a.split else rep for a in args] + [split] * len(cots)
    out_specs = (jax.tree.map(lambda _: split, outs),
                 tuple(split if args[i].split else rep for i in diff)) if diff else (
                     jax.tree.map(lambda _: split, outs),)
    shard = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
        (shape[0] * n, *shape[1:]) if spec == split else shape, dtype,
        sharding=NamedSharding(mesh, spec))
    global_args = tuple(shard(x.shape, x.dtype, sp) for x, sp in zip(local + cots, specs))
    return jax.jit(jax.shard_map(program, mesh=mesh, in_specs=tuple(specs),
                                 out_specs=out_specs, check_vma=False)), global_args


def compile_kernels(cfg: ExperimentConfig, topo: Topology) -> list[Compiled]:
    """AOT-compile the Pallas kernels for `topo` (`kernel_programs` on its devices)."""
    devs = devices(topo)
    slices = sharding.slice_indices(sharding.config_mesh(cfg.mesh, devs, cfg.mesh_dcn))
    return [dataclasses.replace(compile_lowered(label, lambda p=program, a=args: p.lower(*a)),
                                slices=slices)
            for label, program, args in kernel_programs(cfg, devs)]
