"""Multi-process runs (JAX's multi-controller runtime): one process per host of a pod,
every process running the same program on its slice of the data.

Letters: B rows of a global batch; n processes.

- `initialize` starts `jax.distributed` when the run is multi-process: from the explicit
  coordinator / count / id (the `--coordinator --num-processes --process-id` flags of the
  entry points), from the usual environment variables (JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID), or on a TPU pod from the environment JAX detects
  itself (`tpu_pod=True`). On CPU it selects Gloo collectives. A process whose peer dies
  stops within `heartbeat_timeout_seconds` with JAX's "another task died" error instead
  of waiting forever.
- Batch rows are split over processes in contiguous blocks: process p holds rows
  [p·B/n, (p+1)·B/n) of every batch tensor (`local_rows`), so it builds, samples, decodes
  and rewards only those (`rows_of_process`). A group of G responses must not straddle two
  processes (its advantage baseline is a mean over the whole group), so B/n must be a
  multiple of G; `check_rows` says so when it is not.
- Host-side values (rewards, lengths, eval scores) are combined with `gather`; only
  process 0 writes metrics, logs and plots (`is_main`), while every process writes its
  part of a checkpoint (orbax).
"""
from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, tpu_pod: bool = False,
               heartbeat_timeout_seconds: int = 100, initialization_timeout: int = 300) -> bool:
    """Start the multi-controller runtime if this is a multi-process run; returns whether
    it is. Must run before anything else touches a JAX device."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0")) or None
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if not (coordinator or tpu_pod):
        if num_processes not in (None, 1):
            raise ValueError(f"--num-processes={num_processes} needs --coordinator host:port "
                             "(or JAX_COORDINATOR_ADDRESS)")
        return False
    if coordinator and (num_processes is None or process_id is None):
        raise ValueError("--coordinator needs --num-processes and --process-id (or "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    if process_id is not None and num_processes and not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id={process_id} must be in [0, --num-processes="
                         f"{num_processes})")
    if jax.config.jax_platforms in (None, "", "cpu") and not tpu_pod:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    return True


def add_arguments(ap) -> None:
    """The multi-process flags of every entry point (argparse)."""
    ap.add_argument("--coordinator", default=None,
                    help="host:port of process 0 for a multi-process run (TPU pods: omit, "
                         "and pass --tpu-pod); or JAX_COORDINATOR_ADDRESS")
    ap.add_argument("--num-processes", type=int, default=None, help="or JAX_NUM_PROCESSES")
    ap.add_argument("--process-id", type=int, default=None, help="or JAX_PROCESS_ID")
    ap.add_argument("--tpu-pod", action="store_true",
                    help="a TPU pod slice: JAX finds the coordinator and processes itself")


def initialize_from(args) -> bool:
    """`initialize` from the flags of `add_arguments`."""
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      tpu_pod=args.tpu_pod)


def is_main() -> bool:
    """Whether this process writes the run's metrics, logs and plots."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (no-op in a single-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def check_rows(rows: int, group_size: int, what: str) -> None:
    """Every process must hold whole groups of responses (module docstring)."""
    p = jax.process_count()
    if rows % p or (rows // p) % group_size:
        raise ValueError(
            f"{what}: {rows} rows over {p} processes must give each process a multiple of "
            f"the group size {group_size} (a group's advantages use all its responses, so a "
            "group cannot straddle two hosts); change rl.prompts_per_step or the number of "
            "processes")


def rows_of_process(rows: int) -> slice:
    """The contiguous block of a batch's rows this process builds and reads."""
    p, n = jax.process_index(), jax.process_count()
    if rows % n:
        raise ValueError(f"a batch of {rows} rows cannot be split over {n} processes")
    return slice(p * rows // n, (p + 1) * rows // n)


def local_rows(x) -> np.ndarray:
    """This process's block of rows of a batch-sharded global array (or of a host array
    every process holds), on the host."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)[rows_of_process(x.shape[0])]
    shards = {s.index[0].start or 0: s for s in x.addressable_shards}
    block = rows_of_process(x.shape[0])
    out = np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])
    starts = sorted(shards)
    if starts[0] != block.start or len(out) != block.stop - block.start:
        raise ValueError(f"this process holds rows {starts} of {x.shape[0]}, not the block "
                         f"{block}; build the mesh over jax.devices() in process order")
    return out


def gather(x_local):
    """The concatenation over processes (in process order) of each process's rows: of an
    array, or of every array of a pytree (a scalar leaf is stacked), in one collective:
    the leaves' bytes travel as one buffer (`process_allgather` alone runs one per leaf).
    Every process passes leaves of the same shapes and dtypes."""
    x_local = jax.tree.map(np.asarray, x_local)
    if jax.process_count() == 1:
        return x_local
    leaves, tree = jax.tree.flatten(x_local)
    buffer_nxb = np.asarray(multihost_utils.process_allgather(pack_bytes(leaves)))
    return jax.tree.unflatten(tree, unpack_bytes(buffer_nxb, leaves))


def pack_bytes(leaves) -> np.ndarray:
    """The bytes of host arrays, one after the other, as one uint8 vector."""
    return np.concatenate([np.zeros(0, np.uint8)] + [
        np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves])


def unpack_bytes(buffer_nxb: np.ndarray, like) -> list[np.ndarray]:
    """`pack_bytes`' buffers of n processes (row p is process p's) as arrays shaped and typed
    as the leaves `like`, each the concatenation of the processes' leaves over axis 0
    (stacked for a scalar leaf)."""
    out, start = [], 0
    for x in like:
        stop = start + x.nbytes
        parts = [row[start:stop].copy().view(x.dtype).reshape(x.shape) for row in buffer_nxb]
        out.append(np.stack(parts) if x.ndim == 0 else np.concatenate(parts))
        start = stop
    return out


def host(x) -> np.ndarray:
    """A replicated (or single-process) array on the host: a jitted step's metrics and
    counters. Every process holds a full copy, so no communication is needed."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def to_global(x, sharding, batch: bool) -> jax.Array:
    """A host or process-local value as a global array on `sharding`: with `batch`, `x`
    is this process's block of rows (`rows_of_process`); otherwise it is a full copy that
    every process holds (parameters read by each host, a key)."""
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding):
        return x  # already global, or already where it goes
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = to_global(jax.random.key_data(x), sharding, batch)
        return jax.random.wrap_key_data(data, impl=impl)
    value = np.asarray(x)
    if batch:
        return jax.make_array_from_process_local_data(sharding, value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
