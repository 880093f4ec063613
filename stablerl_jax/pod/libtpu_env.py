"""libtpu on a host without a TPU: start quietly.

With the `tpu` extra, JAX tries libtpu whenever it starts backends; on a chipless host it then
looks for the TPU metadata server and the pod's worker list, printing an
`INVALID_ARGUMENT … TPU_WORKER_HOSTNAMES` trace to stderr before falling back to the CPU. Where
no chip is attached (TPU hosts keep their chips), `quiet_libtpu` sets a one-worker slice's
settings needing no metadata server (which also let `jax.experimental.topologies` describe a TPU
pod anywhere: aot.py), among them ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu's lockfile
(/tmp/libtpu_lockfile) keeps two processes off the same chips (none here) and would fail an AOT
compile or `pytest -m tpu` beside a running experiment ("Internal error when accessing libtpu
multi-process lockfile"). Entry points (experiments/__init__.py, benchmarks/__init__.py) call it
before any backend starts. Imports nothing of ours; JAX's PCI scan starts no backend."""
from __future__ import annotations

import glob
import os

# Defaults only: a variable already set wins.
QUIET_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5p-8",
             "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def tpu_chips() -> int:
    """TPU chips here: the larger of JAX's PCI count of TPU devices (`jax._src.hardware_utils`)
    and the device files (`/dev/accel<n>`, `/dev/vfio/<n>`). Starts no backend."""
    files = len(glob.glob("/dev/accel[0-9]*")) + len(glob.glob("/dev/vfio/[0-9]*"))
    try:
        from jax._src import hardware_utils
        pci = hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError, OSError):  # a private API: the files decide
        pci = 0
    return max(pci, files)


def quiet_libtpu(chips: int | None = None) -> bool:
    """Set `QUIET_ENV` (defaults only) when this host has no TPU chip (`chips`: the count,
    default `tpu_chips()`); returns whether it did. Call before JAX starts a backend."""
    if (tpu_chips() if chips is None else chips) > 0:
        return False
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    return True
