"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel + parameter sharding),
`expert` (expert parallel). Model code names only logical axes (see
`transformer.param_logical_axes`); this module alone knows the mesh.

A job larger than one TPU slice spans several slices joined by the data-center network
(DCN), much slower than the chips' interconnect (ICI) inside a slice. `mesh` stays the
full (data, fsdp, expert) shape; `mesh_dcn` says how many slices each axis spans, so a
slice holds a mesh / mesh_dcn block and only the axes with a DCN factor > 1 talk over DCN
(usually `data`: one gradient all-reduce per update crosses it).

Letters: B batch, T tokens.
"""
from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
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
# The logical axes of one layer's expert weights (transformer.param_logical_axes without
# the leading `layers`): what the expert FFN's shard_map shards them by.
EXPERT_WEIGHT_AXES = {"w_gate": ("experts", "embed", "mlp"),
                      "w_up": ("experts", "embed", "mlp"),
                      "w_down": ("experts", "mlp", "embed")}


def serve_rules(expert_parallel: bool) -> dict:
    """SERVE_RULES for a model whose expert FFN is expert parallel; without expert
    parallelism (every device runs every expert) the experts are replicated too."""
    return SERVE_RULES if expert_parallel else {**SERVE_RULES, "experts": None}


def spec_axes(part) -> tuple:
    """Mesh axes of one PartitionSpec entry (None, an axis name or a tuple), as a tuple."""
    return () if part is None else (part if isinstance(part, tuple) else (part,))


def slice_count(devices) -> int:
    """Slices (TPU slices joined by the data-center network) that `devices` belong to, by
    their `slice_index`; devices without one (CPU, GPU) count as one slice."""
    return len({getattr(d, "slice_index", 0) for d in devices})


def slice_indices(mesh: Mesh) -> tuple:
    """The slice of each of the mesh's devices, in the mesh's flat order: the order of a
    program's device assignment, i.e. the device ids of its HLO replica groups."""
    return tuple(getattr(d, "slice_index", 0) for d in mesh.devices.flat)


def make_mesh(data: int = 1, fsdp: int = 1, expert: int = 1, devices=None,
              dcn: tuple = (1, 1, 1)) -> Mesh:
    """A (data, fsdp, expert) mesh with Auto axes (the compiler propagates shardings).

    `dcn` (ExperimentConfig.mesh_dcn): how many slices each axis spans. Within a slice
    the devices form a (data, fsdp, expert) / dcn block over the chips' interconnect
    (ICI); an axis with a DCN factor > 1 crosses slices over the data-center network
    in its outer part (`mesh_utils.create_hybrid_device_mesh`: slice k is block k of the
    dcn grid, row-major). Its product must be the devices' slice count (`slice_count`).
    """
    devices = jax.devices() if devices is None else devices
    want = data * fsdp * expert
    if want != len(devices):
        raise ValueError(f"mesh: data*fsdp*expert = {data}*{fsdp}*{expert} = {want} must equal "
                         f"the number of devices ({len(devices)}); change the mesh shape")
    shape, dcn = (data, fsdp, expert), tuple(dcn)
    if any(m % d for m, d in zip(shape, dcn)):
        raise ValueError(f"mesh_dcn={dcn} must divide mesh={shape} axis by axis (the "
                         "slices each axis spans); change mesh_dcn or the mesh")
    slices, asked = slice_count(devices), math.prod(dcn)
    if asked != slices:
        have = ("have no slice_index: one slice" if not hasattr(devices[0], "slice_index")
                else f"are in {slices} slice(s)")
        fix = (f"mesh_dcn={slices},1,1 puts the data axis across them" if slices > 1
               else "set mesh_dcn=1,1,1")
        raise ValueError(f"mesh_dcn={dcn} spans {asked} slice(s) but the {len(devices)} "
                         f"{devices[0].platform} devices {have}; {fix} (its product must "
                         "be the number of slices)")
    # Splitting a physical torus axis between two mesh axes is allowed (XLA's layout
    # tries it only where no whole-axis assignment exists): a mesh, or a slice's block,
    # need not match the torus axis by axis, e.g. (2, 8, 8) on a 4x4x8 v5p-256 or
    # (1, 8, 8) on a 4x4x4 v5p-128.
    if slices == 1:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        ici = tuple(m // d for m, d in zip(shape, dcn))
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                    allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def config_mesh(mesh_shape: tuple, devices=None, dcn_shape: tuple = (1, 1, 1)) -> Mesh:
    """The mesh of a config's `mesh` (data, fsdp, expert) and `mesh_dcn` over the first
    devices of `devices` (default: the default backend's); `make_mesh` on exactly those."""
    devices = jax.devices() if devices is None else list(devices)
    n = mesh_shape[0] * mesh_shape[1] * mesh_shape[2]
    if n > len(devices):
        raise ValueError(f"mesh={mesh_shape} needs {n} devices, only {len(devices)} are "
                         "visible; shrink the mesh (override mesh=data,fsdp,expert)")
    return make_mesh(*mesh_shape, devices=devices[:n], dcn=dcn_shape)


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
