"""The kernels: every implementation of an op, and one table per op that names them.

For an op X:

    X.py          the op's dispatcher `X(..., impl=name)` and its pure-JAX
                  implementations, the reference first
    X_pallas.py   its Pallas kernels; the implementation that runs them is here when
                  it has a VJP of its own (gmm_pallas.pallas), in X.py when it shares
                  one with a pure-JAX implementation (fused_logprob.pallas)
    X_impls.py    its table (name -> `Impl`, each row saying what it is), its block
                  sizes, and the example shapes the AOT command (aot.compile_kernels)
                  compiles it at; no JAX import, so the config validates names against
                  the table when it is imported

An implementation is named after its row ("loop" is `gmm.loop`); the rows of one
function for several targets are `<name>_<target>` ("pallas_gpu" is `gmm_pallas.pallas`
with target="gpu"). A caller that picks a row by name looks it up once: `lookup(table,
name, field).load(block=, interpret=)` is the callable, and the dispatcher is that
call on the op's arguments.

Ops, each as X.py, X_pallas.py and X_impls.py:

    fused_logprob     the fused token log-prob / entropy (`LOGPROB_IMPLS`,
                      RLConfig.logprob_impl)
    gmm               the grouped matmul of the MoE expert FFN (`GMM_IMPLS`,
                      ModelConfig.gmm_impl)
    decode_attention  a decode step's blocked attention (`DECODE_IMPLS`,
                      ModelConfig.decode_attention_impl)
    dtypes.py         the dtype helpers the kernels share

The model, the config, the AOT kernel list, the kernel
tests and the benchmarks all read the tables, so a new implementation is one function
and one table row (docs/architecture.md, "Add a kernel"). Shape letters are those of
docs/architecture.md's "Names"; each module lists the ones it uses.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Mapping, NamedTuple

TARGETS = ("gpu", "tpu")  # what a Pallas kernel is compiled for: Triton or Mosaic
BACKENDS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op: a row of the op's table.

    fn: "module:attribute" of the callable, imported on first use (the table itself
      imports no JAX).
    options: keyword arguments bound to it (e.g. a Pallas kernel's `target`).
    backends: the JAX platforms it compiles for.
    blocks: its default block sizes (the op's block-size dataclass), passed as `block=`;
      None for an implementation without tiles.
    pallas: a Pallas kernel. It also accepts `interpret=True` (Pallas's checking
      interpreter, on any backend: how the CPU tests run it), it is opaque to XLA's
      partitioner (callers run it per device under shard_map), and `aot.compile_kernels`
      compiles it for a TPU topology when "tpu" is among its backends.
    """

    fn: str
    backends: tuple[str, ...]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    blocks: Any = None
    pallas: bool = False

    def __post_init__(self):
        if self.fn.count(":") != 1:
            raise ValueError(f"Impl.fn={self.fn!r} must be 'module:attribute'")
        if not set(self.backends) <= set(BACKENDS):
            raise ValueError(f"Impl.backends={self.backends!r} must be among {BACKENDS}")

    def load(self, *, block: Any = None, interpret: bool = False) -> Callable:
        """The callable with its options bound; with its block sizes, `block` or else its
        defaults, when it has tiles (`block` is ignored otherwise); and, for a Pallas
        kernel, `interpret` (ignored otherwise). Bound by keyword: a caller's own
        `block=` or `interpret=` still overrides them."""
        module, attr = self.fn.split(":")
        fn = getattr(importlib.import_module(module), attr)
        bound = dict(self.options)
        if self.blocks is not None:
            bound["block"] = self.blocks if block is None else block
        if self.pallas:
            bound["interpret"] = interpret
        return functools.partial(fn, **bound) if bound else fn


def check_blocks(blocks, zero_ok: tuple[str, ...] = ()) -> None:
    """Raise ValueError unless every field of the block-size dataclass `blocks` is a
    positive int (or 0, for the fields in `zero_ok`)."""
    for f in dataclasses.fields(blocks):
        v = getattr(blocks, f.name)
        if not (isinstance(v, int) and v >= (0 if f.name in zero_ok else 1)):
            raise ValueError(f"{type(blocks).__name__}.{f.name}={v!r} must be a positive int")


def lookup(table: Mapping[str, Impl], name: str, field: str) -> Impl:
    """table[name], or a ValueError naming `field` and the choices."""
    if name not in table:
        raise ValueError(f"{field}={name!r} must be one of {tuple(table)}")
    return table[name]


class Arg(NamedTuple):
    """One array argument of an op at example sizes (an op's `*_example_args`): `shape`
    per device; `split`: its leading dim is split over the data-parallel devices (else
    every device holds all of it); `diff`: differentiated when the op is compiled forward
    + backward."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    split: bool
    diff: bool
