"""The kernels: every implementation of an op, and one table per op that names them.

Ops, each as X.py (the dispatcher `X(..., impl=name)` and the pure-JAX implementations,
the reference first), X_pallas.py (its Pallas kernels) and X_impls.py (its table, name
-> `Impl`, block sizes and the example shapes the AOT command, aot.compile_kernels,
compiles it at; no JAX import, so the config validates names against the table on import):

    fused_logprob     fused token log-prob / entropy (`LOGPROB_IMPLS`, RLConfig.logprob_impl)
    gmm               the MoE expert FFN's grouped matmul (`GMM_IMPLS`, ModelConfig.gmm_impl)
    decode_attention  a decode step's blocked attention (`DECODE_IMPLS`,
                      ModelConfig.decode_attention_impl)
    dtypes.py         the dtype helpers the kernels share

An implementation is named after its row ("loop" is `gmm.loop`), one function's rows for
several targets `<name>_<target>` ("pallas_gpu" is `gmm_pallas.pallas` with
target="gpu"). One that runs Pallas kernels is in X_pallas.py when it has a VJP of its own
(gmm_pallas.pallas), in X.py when it shares a pure-JAX one's (fused_logprob.pallas). A
caller looks a row up once: `lookup(table, name, field).load(block=, interpret=)` is the
callable, and the dispatcher is that call on the op's arguments. The model, config, AOT
kernel list, kernel tests and benchmarks all read the tables, so a new implementation is
one function and one row (docs/architecture.md, "Add a kernel"). Shape letters are those
of docs/architecture.md's "Names"; each module lists its own.
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
    """A row of an op's table. fn: "module:attribute" of the callable, imported on first
    use (the table imports no JAX); options: keywords bound to it (e.g. a Pallas kernel's
    `target`); backends: the JAX platforms it compiles for; blocks: its default block sizes
    (the op's block dataclass), passed as `block=`, None without tiles. pallas: a Pallas
    kernel: it accepts `interpret=True` (the checking interpreter, any backend: how the CPU
    tests run it), is opaque to XLA's partitioner (callers run it per device under shard_map),
    and `aot.compile_kernels` compiles it for a TPU topology if "tpu" is a backend."""

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
        """The callable with its options, `block` (else its defaults; with tiles only) and
        `interpret` (Pallas only) bound by keyword: a caller's `block=` / `interpret=` wins."""
        module, attr = self.fn.split(":")
        fn = getattr(importlib.import_module(module), attr)
        bound = dict(self.options)
        if self.blocks is not None:
            bound["block"] = self.blocks if block is None else block
        if self.pallas:
            bound["interpret"] = interpret
        return functools.partial(fn, **bound) if bound else fn


def check_blocks(blocks, zero_ok: tuple[str, ...] = ()) -> None:
    """ValueError unless every field of `blocks` is a positive int (or 0, in `zero_ok`)."""
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
    """An op's array argument at example sizes (`*_example_args`): `shape` per device;
    `split`: leading dim split over the data-parallel devices (else whole on each); `diff`:
    differentiated when the op is compiled forward + backward."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    split: bool
    diff: bool
