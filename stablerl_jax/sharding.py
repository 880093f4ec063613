"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel + parameter sharding),
`expert` (expert parallel). Model code names only logical axes (see
`transformer.param_logical_axes`); this module alone knows the mesh.

Letters: B batch, T tokens.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
# Batch is split over every mesh axis (the expert axis too: outside the expert FFN every
# device is data parallel, and model/expert_parallel.py gathers tokens over `expert` for
# the experts); parameters are split over fsdp along their model dimension and over
# expert along the expert dimension.
RULES = {
    "batch": ("data", "fsdp", "expert"),
    "embed": "fsdp",
    "experts": "expert",
    "vocab": None,
    "layers": None,
    "heads": None,
    "kv_heads": None,
    "head_dim": None,
    "mlp": None,
    "norm": None,
    "router_experts": None,
    "seq": None,
}

# The sampler's serving layout (SamplingConfig.layout='serve'; rollout.py): what the
# decode loop holds resident so that it moves only activations. Every weight but the
# experts' is replicated (attention, router, norms, embedding and unembedding: no
# all-gather per token or per layer); the experts are spread over every mesh axis
# (E / devices per chip, expert parallel over the whole mesh: each decode step exchanges
# its tokens' activations, model/expert_parallel.py); rows and their KV cache stay split
# over every axis, as in training. The experts split over `expert` first, then `fsdp`:
# each chip's serving experts are then among the E / expert it already holds a slice of
# in training, so the reshard gathers only those (the other order makes the partitioner
# replicate whole expert weights first).
SERVE_RULES = {**RULES, "embed": None, "experts": ("expert", "fsdp", "data")}


def serve_rules(expert_parallel: bool) -> dict:
    """SERVE_RULES for a model whose expert FFN is expert parallel; without expert
    parallelism (every device runs every expert) the experts are replicated too."""
    return SERVE_RULES if expert_parallel else {**SERVE_RULES, "experts": None}


def make_mesh(data: int = 1, fsdp: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, expert) mesh with Auto axes (the compiler propagates shardings)."""
    devices = jax.devices() if devices is None else devices
    want = data * fsdp * expert
    if want != len(devices):
        raise ValueError(f"mesh: data*fsdp*expert = {data}*{fsdp}*{expert} = {want} must equal "
                         f"the number of devices ({len(devices)}); change the mesh shape")
    return jax.make_mesh((data, fsdp, expert), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)


def config_mesh(mesh_shape: tuple, devices=None) -> Mesh:
    """The mesh of a config's `mesh` (data, fsdp, expert) over the first devices of
    `devices` (default: the default backend's); `make_mesh` on exactly those."""
    devices = jax.devices() if devices is None else list(devices)
    n = mesh_shape[0] * mesh_shape[1] * mesh_shape[2]
    if n > len(devices):
        raise ValueError(f"mesh={mesh_shape} needs {n} devices, only {len(devices)} are "
                         "visible; shrink the mesh (override mesh=data,fsdp,expert)")
    return make_mesh(*mesh_shape, devices=devices[:n])


def spec(logical: tuple, shape: tuple, mesh: Mesh, rules: dict = RULES) -> P:
    """PartitionSpec for one array; a dim whose size the mesh axes don't divide is replicated."""
    parts = []
    for name, size in zip(logical, shape):
        if name not in rules:
            raise KeyError(f"sharding rules: no entry for logical axis {name!r}; add it to RULES")
        axes = rules[name]
        if axes is not None:
            axes_t = axes if isinstance(axes, tuple) else (axes,)
            if size % math.prod(mesh.shape[a] for a in axes_t):
                axes = None
        parts.append(axes)
    return P(*parts)


def tree_shardings(logical_tree, arrays, mesh: Mesh, rules: dict = RULES):
    """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) given its logical axes."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)
    return jax.tree.map(lambda axes, a: NamedSharding(mesh, spec(axes, a.shape, mesh, rules)),
                        logical_tree, arrays, is_leaf=is_axes)


def batch_sharding(mesh: Mesh, rules: dict = RULES) -> NamedSharding:
    """Axis 0 (the batch) split over the data-parallel axes, every other axis replicated.
    Every batch tensor is batch-major, so this one sharding serves a whole batch pytree
    (as a prefix of its tree in jit's in/out shardings)."""
    return NamedSharding(mesh, P(rules["batch"]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
