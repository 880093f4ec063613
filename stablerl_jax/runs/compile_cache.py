"""JAX's persistent compilation cache for the entry points.

Experiments recompile the same programs: each (variant, seed) run builds its own Engine, a
resumed run starts from nothing, and each trimmed rollout width (rl.trim_bucket) is its own
score and update program. With the cache, XLA compiles a program once per machine and later runs
load it (entries are keyed by program, compile options and jax / XLA version: never stale). On 2
CPU cores this takes about 10 s off the start of every tiny run (docs/records/benchmarks.md)."""
from __future__ import annotations

import os

import jax

DEFAULT = os.path.join("~", ".cache", "stablerl_jax", "xla")


def add_argument(ap) -> None:
    """The `--compile-cache DIR` flag of an entry point ('' turns the cache off)."""
    ap.add_argument("--compile-cache",
                    default=os.environ.get("STABLERL_JAX_COMPILE_CACHE", DEFAULT),
                    help="directory of JAX's persistent compilation cache, '' = off "
                         f"(default: $STABLERL_JAX_COMPILE_CACHE or {DEFAULT})")


def enable(path: str) -> None:
    """Persist every compiled program (however quick to compile) under `path`; '' = off."""
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
