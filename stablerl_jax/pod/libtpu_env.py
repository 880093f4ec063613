"""libtpu on a host without a TPU: start quietly.

With the `tpu` extra installed, JAX tries libtpu's backend whenever it starts its
backends. On a host with no TPU chip libtpu then looks for the TPU metadata server and the
pod's worker list, and prints an `INVALID_ARGUMENT … TPU_WORKER_HOSTNAMES` trace to
stderr before falling back to the CPU. `quiet_libtpu` gives libtpu the settings of a
one-worker slice that needs no metadata server (the same settings let
`jax.experimental.topologies` describe a TPU pod on any host, aot.py), and only when no
TPU chip is attached: on a TPU host it changes nothing, so the real chips are used.
Among them, ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu's lockfile (/tmp/libtpu_lockfile) keeps
two processes off the same chips, and a host with none has nothing to guard, while the
lock would make an AOT compile or `pytest -m tpu` beside a running experiment fail
("Internal error when accessing libtpu multi-process lockfile").
The entry points call it first (experiments/__init__.py, benchmarks/__init__.py), before
JAX starts a backend. Imports nothing of ours; JAX's PCI scan is imported, which starts
no backend.
"""
from __future__ import annotations

import glob
import os

# Defaults only: a variable already set wins.
QUIET_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v5p-8",
             "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def tpu_chips() -> int:
    """TPU chips attached to this host: JAX's count of Google TPU devices on the PCI bus
    (`jax._src.hardware_utils`), or the TPU device files (`/dev/accel<n>`,
    `/dev/vfio/<n>`), whichever finds more. Starts no backend."""
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
