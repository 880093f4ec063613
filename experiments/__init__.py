"""Experiment entry points: `python -m experiments.<name>`.

Every module of this package is one of three kinds. An experiment (variants × seeds from
one preset, the shared command line and report) defines `EXPERIMENT = cli.Descriptor(...)`
and `main = EXPERIMENT.main`; `descriptors()` finds them all, so a new experiment is its
one file. `OTHER_ENTRY_POINTS` run something else under their own command line, and
`SHARED` are the code the others import. A module of none of the three kinds is an error.

Importing the package comes before anything else an entry point does, so this is where a
host without a TPU tells libtpu (the `tpu` extra) not to probe for hardware, before JAX
starts a backend (stablerl_jax/pod/libtpu_env.py; a TPU host is left as it is).
"""
from __future__ import annotations

import importlib
import pkgutil

from stablerl_jax.pod.libtpu_env import quiet_libtpu

quiet_libtpu()

# train: one SFT + RL run (quickstart: its former name, kept working); main_job_seeds: train
# at several seeds; aot_compile: TPU memory fit of a preset's steps; length_stats: a cold
# start's mismatch by router noise (no RL runs); bitwise_check: does the sampler compute the
# trainer's numbers here; parity: a checkpoint's logits against transformers'.
OTHER_ENTRY_POINTS = ("aot_compile", "bitwise_check", "length_stats", "main_job_seeds", "parity",
                      "quickstart", "train")
SHARED = ("cli", "cli_errors", "report", "runner", "stats")


def module_names() -> list[str]:
    """Every module of this package, by name."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg)


def descriptors() -> dict:
    """{name: the module's EXPERIMENT (a cli.Descriptor)} of every experiment module: each
    module here neither in OTHER_ENTRY_POINTS nor in SHARED. Imports them (and so JAX)."""
    from experiments.cli import Descriptor
    found = {}
    for name in module_names():
        if name in OTHER_ENTRY_POINTS or name in SHARED:
            continue
        desc = getattr(importlib.import_module(f"experiments.{name}"), "EXPERIMENT", None)
        if not isinstance(desc, Descriptor):
            raise TypeError(
                f"experiments/{name}.py: no EXPERIMENT = cli.Descriptor(...); an experiment "
                "defines one (docs/architecture.md, 'Add an experiment'), another entry "
                "point belongs in experiments.OTHER_ENTRY_POINTS, shared code in SHARED")
        found[name] = desc
    return found
