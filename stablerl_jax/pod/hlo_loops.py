"""Loops and collectives of an optimized HLO module (the text of `Compiled.as_text()`).

XLA's cost analysis counts a while-loop body once, however often it runs. This module reads the
loop structure instead: computations, their while loops and trip counts (XLA's
`known_trip_count`; a data-dependent loop such as the sampler's decode loop has none: the caller
gives it), and each collective's bytes, so a step's collective traffic can be stated per loop
iteration (a decode step, layer or micro-batch) and in total, nested loops multiplied out.

Bytes of a collective, per chip (the buffer crossing the interconnect, up to the (n − 1)/n a
ring keeps on the chip): all-gather its result, reduce-scatter its operand, all-to-all and
collective-permute their result, all-reduce twice its result (reduce-scatter + all-gather), a
ragged all-to-all the smaller of operand and result (the rows it sends, when each chip sends and
receives as many). An async start/done pair counts once.

Over which network. A multi-slice program (devices with a `slice_index`, sharding.make_mesh) is
compiled as one slice's (num_partitions = a slice's devices): XLA's TPU compiler splits a
collective whose groups cross slices into in-slice collectives (ICI) and a transfer between
slices over the data-center network (DCN), a `send` to the `xla_megascale_runtime` with its
`_xla_megascale_transfer_type` (an all-reduce across slices: in-slice reduce-scatter, DCN
all-reduce of each chip's shard, in-slice all-gather). A transfer moves per chip the buffer it
sends, an all-reduce across k slices 2 (k − 1) / k of it (a ring; at k = 2 the buffer once each
way). A module keeping whole-mesh collectives (num_partitions = every device) is classified by
replica groups: DCN when a group spans slices."""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import numpy as np

COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce",
               "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "s16": 2, "u16": 2,
          "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
          "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=(\{(?:\{[\d,]*\},?)*\}|"
                     r"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_DCN = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")


def dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4"):
        return 1 if dtype.startswith("f8") else 0.5
    return _BYTES.get(dtype, 0)


def arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape's text (a tuple lists several)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d))
            for t, dims in _ARRAY.findall(shape_text) if dtype_bytes(t)]


def nbytes(shape_text: str) -> float:
    return sum(dtype_bytes(t) * math.prod(d) for t, d in arrays(shape_text))


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    shape: str      # the result's shape text
    operands: str   # the text inside the opcode's parentheses
    attrs: str      # everything after them

    @property
    def collective(self) -> str | None:
        """The collective kind, for a collective or the start of an async one."""
        op = self.opcode.removesuffix("-start").removeprefix("ragged-")
        return op if op in COLLECTIVES and not self.opcode.endswith("-done") else None

    def collective_bytes(self, shapes: dict | None = None) -> float:
        """Bytes this collective moves per chip; `shapes` (instruction name -> result shape
        text) resolves an operand named without its shape."""
        kind = self.collective
        if kind is None:
            return 0.0
        out = max((dtype_bytes(t) * math.prod(d) for t, d in arrays(self.shape)),
                  default=0.0)  # an async start's tuple holds (operand, result)
        if kind == "reduce-scatter":
            return max(out, nbytes(self.operands))
        if self.opcode.startswith("ragged-"):
            # Its buffers are sized for the worst case; what crosses is the rows sent,
            # at most the operand and at most the output (whichever the static shapes
            # bound: the smaller), and every chip's mean when the rows are balanced.
            first = self.operands.split(",")[0]
            name = re.search(r"%([\w.\-]+)", first)
            sent = nbytes(first) or nbytes((shapes or {}).get(name and name.group(1), ""))
            return min(out, sent) if sent else out
        return 2 * out if kind == "all-reduce" else out

    def device_groups(self, num_devices: int) -> list[tuple[int, ...]]:
        """A collective's device groups: replica groups (listed, or iota `[G,S]<=[dims]T(perm)`:
        arange(prod(dims)) reshaped to dims, transposed by perm, as G groups of S) or a
        collective-permute's source-target pairs; none (`{}`): one group of all `num_devices`."""
        m = _GROUPS.search(self.attrs)
        if m is None or m.group(1) == "{}":
            return [tuple(range(num_devices))]
        text = m.group(1)
        if text.startswith("{"):
            return [tuple(int(x) for x in g.split(",") if x)
                    for g in re.findall(r"\{([\d,]*)\}", text[1:-1])]
        ints = lambda t: [int(x) for x in t.split(",")]
        shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                         text).groups()
        ids = np.arange(math.prod(ints(dims))).reshape(ints(dims))
        if perm:
            ids = ids.transpose(ints(perm))
        return [tuple(g) for g in ids.reshape(ints(shape)).tolist()]

    @property
    def dcn_transfer(self) -> str | None:
        """Kind of a transfer between slices (a megascale `send`: e.g. 'ALL_REDUCE') or None."""
        m = _DCN.search(self.attrs) if self.opcode == "send" else None
        return m.group(1) if m else None


@dataclasses.dataclass(frozen=True)
class Loop:
    name: str            # the while instruction
    parent: str          # the computation it is in
    body: str
    trip: int | None     # XLA's known trip count; None: data dependent
    op_name: str         # the JAX source path of the loop (metadata)
    function: str = ""   # the Python function whose code made the loop (stack frame)
    condition: str = ""  # its condition's computation


class Module:
    """The computations of an optimized HLO module and the loops among them."""

    def __init__(self, hlo_text: str):
        self.computations: dict[str, list[Instr]] = {}
        self.entry = None
        # The module's source tables: stack frame -> file location -> function name.
        tables = {"FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
        table = None
        current = None
        for line in hlo_text.splitlines():
            if line in tables or line == "FileNames":
                table = tables.get(line, {})
                continue
            if table is not None and line and not line.startswith("%") \
                    and not line.startswith("ENTRY") and not line.startswith("HloModule"):
                key, _, value = line.partition(" ")
                if key.isdigit():
                    table[int(key)] = value
                    continue
            table = None
            h = _HEADER.match(line)
            if h:
                current = self.computations.setdefault(h.group(1), [])
                if line.startswith("ENTRY"):
                    self.entry = h.group(1)
                continue
            m = _INSTR.match(line) if current is not None else None
            if m:
                rest = m.group(4)
                depth, cut = 1, len(rest)
                for i, ch in enumerate(rest):
                    depth += (ch == "(") - (ch == ")")
                    if depth == 0:
                        cut = i
                        break
                current.append(Instr(m.group(1), m.group(3), m.group(2), rest[:cut],
                                     rest[cut + 1:]))
        self._tables = tables
        self._by_name = {i.name: i for instrs in self.computations.values() for i in instrs}
        self.shapes = {name: i.shape for name, i in self._by_name.items()}
        counts = dict(re.findall(r"\b(num_partitions|replica_count)=(\d+)",
                                 hlo_text[:hlo_text.find("\n")]))
        # The devices the program runs on: one slice's for a multi-slice TPU program.
        self.num_devices = int(counts.get("num_partitions", 1)) * int(
            counts.get("replica_count", 1))

    def function_of(self, ins: Instr) -> str:
        """An instruction's Python function (innermost stack frame); '' without source tables."""
        frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
        t = self._tables
        try:
            loc = re.search(r"file_location_id=(\d+)", t["StackFrames"][int(frame.group(1))])
            fn = re.search(r"function_name_id=(\d+)", t["FileLocations"][int(loc.group(1))])
            return t["FunctionNames"][int(fn.group(1))].strip('"')
        except (AttributeError, KeyError):
            return ""

    def callees(self, ins: Instr) -> list[str]:
        """Computations it calls (fusion, call, branch, async bodies), not a while condition."""
        names = re.findall(r"%([\w.\-]+)", re.sub(r"condition=%[\w.\-]+", "", ins.attrs))
        return [n for n in names if n in self.computations]

    def loops(self) -> list[Loop]:
        out = []
        for comp, instrs in self.computations.items():
            for ins in instrs:
                if ins.opcode != "while":
                    continue
                body = re.search(r"body=%([\w.\-]+)", ins.attrs).group(1)
                cond = re.search(r"condition=%([\w.\-]+)", ins.attrs)
                cond = cond.group(1) if cond else ""
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                op_name = re.search(r'op_name="([^"]*)"', ins.attrs)
                # A loop XLA rewrote (the layer scans of a multi-slice program, one
                # iteration peeled) may lose its metadata and known trip count: its
                # condition `counter < N` still names the function and gives the count.
                root = (self.computations.get(cond) or [None])[-1]
                out.append(Loop(ins.name, comp, body,
                                int(trip.group(1)) if trip else self._counted_trip(ins, root),
                                op_name.group(1) if op_name else "",
                                self.function_of(ins) or (self.function_of(root) if root
                                                          else ""), cond))
        return out

    def _counted_trip(self, loop: Instr, root: Instr | None) -> int | None:
        """N − c for a while loop whose condition's root is `counter < N` (compare LT of a tuple
        element and a constant) and whose counter starts at a constant c; else None (e.g. the
        decode loop, whose condition also reads the rows' EOS flags)."""
        if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
            return None
        names = lambda ins: re.findall(r"%([\w.\-]+)", ins.operands)
        counter, limit = ([self._by_name.get(n) for n in names(root)] + [None, None])[:2]
        index = re.search(r"\bindex=(\d+)", counter.attrs) if counter else None
        if not (index and counter.opcode == "get-tuple-element" and limit
                and limit.opcode == "constant" and limit.operands.isdigit()):
            return None
        init = ([self._by_name.get(n) for n in names(loop)] + [None])[0]
        elements = names(init) if init is not None and init.opcode == "tuple" else []
        start = self._by_name.get(elements[int(index.group(1))]) \
            if int(index.group(1)) < len(elements) else None
        while start is not None and start.opcode in ("copy", "bitcast") and names(start):
            start = self._by_name.get(names(start)[0])
        if start is None or start.opcode != "constant" or not start.operands.isdigit():
            return None
        return int(limit.operands) - int(start.operands)

    def collective_bytes(self, comp: str, trips: dict | None = None) -> dict:
        """Bytes by collective kind of one run of `comp` and its callees, nested loop bodies and
        conditions trip-count times (`trips`: loop name -> count where unknown, else 1)."""
        return self._bytes_by(comp, trips, COLLECTIVES, lambda ins: (
            [(ins.collective, ins.collective_bytes(self.shapes))] if ins.collective else []))

    def network_bytes(self, comp: str, trips: dict | None = None,
                      slices: tuple = ()) -> dict:
        """{"ici", "dcn"} bytes of one run of `comp` (module docstring; loops as in
        `collective_bytes`). `slices`: sharding.slice_indices of the mesh (() for one slice or
        unknown: a between-slice transfer counts its buffer once)."""
        k = len(set(slices))
        whole_mesh = k > 1 and self.num_devices == len(slices)
        ring = 2 * (k - 1) / k if k > 1 else 1.0  # slices unknown: the buffer once

        def link(ins: Instr) -> list:
            kind = ins.dcn_transfer
            if kind:
                buf = max((dtype_bytes(t) * math.prod(d) for t, d in arrays(ins.shape)),
                          default=0.0)
                return [("dcn", buf * (ring if kind == "ALL_REDUCE" else 1.0))]
            if not ins.collective:
                return []
            crosses = whole_mesh and any(len({slices[i] for i in g}) > 1
                                         for g in ins.device_groups(self.num_devices))
            return [("dcn" if crosses else "ici", ins.collective_bytes(self.shapes))]

        return self._bytes_by(comp, trips, ("ici", "dcn"), link)

    def _bytes_by(self, comp: str, trips: dict | None, keys: tuple, of) -> dict:
        """{key: bytes} of one run of `comp`: `of(instruction)` -> [(key, bytes)] summed over
        `comp` and its callees, loop bodies at their trip counts."""
        trips = trips or {}
        loops = {lp.name: lp for lp in self.loops()}

        @functools.lru_cache(maxsize=None)
        def walk(name: str) -> tuple:
            total = dict.fromkeys(keys, 0.0)
            for ins in self.computations[name]:
                for key, nbytes_ in of(ins):
                    total[key] += nbytes_
                times, callees = 1, self.callees(ins)
                if ins.opcode == "while":
                    lp = loops[ins.name]
                    times = lp.trip if lp.trip is not None else trips.get(lp.name, 1)
                    # The condition runs with every iteration (a decode loop's "every row
                    # done?" all-reduce); its one extra run is left out.
                    callees += [lp.condition] if lp.condition in self.computations else []
                for callee in callees:
                    for k, v in walk(callee):
                        total[k] += times * v
            return tuple(total.items())

        return dict(walk(comp))

    def instructions_under(self, comp: str) -> list[Instr]:
        """Each instruction of `comp` and what it calls, transitively (loop bodies too), once."""
        seen, order, stack = set(), [], [comp]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for ins in self.computations[name]:
                order.append(ins)
                stack.extend(self.callees(ins))
                if ins.opcode == "while":
                    cond = re.search(r"condition=%([\w.\-]+)", ins.attrs)
                    if cond:
                        stack.append(cond.group(1))
        return order


def decode_loop(module: Module) -> Loop:
    """The sampler's decode loop: the while loop `rollout._decode` made (by stack frames; else
    the outermost loop without a known trip count, its condition reading the rows' EOS flags)."""
    loops = module.loops()
    named = [lp for lp in loops if lp.function == "_decode"]
    if len(named) == 1:
        return named[0]
    cands = [lp for lp in loops if lp.trip is None]
    if not cands:
        raise ValueError("no data-dependent while loop in this module: not a sample step")
    return min(cands, key=lambda lp: (lp.op_name.count("/"), lp.op_name))


def trips_by_function(module: Module, counts: dict) -> dict:
    """{loop name: trip count} for loops without a known one, from `counts` by the function that
    made them (e.g. {"forward": L}: XLA's TPU programs record none for the layer scan)."""
    return {lp.name: counts[lp.function] for lp in module.loops()
            if lp.trip is None and lp.function in counts}
