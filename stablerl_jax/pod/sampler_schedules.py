"""Response lengths and the sampler's three schedules, simulated (numpy only: no model).

Letters: B responses of a global step, G group size, Q = B/G groups, P prompt slots, C =
max_new_tokens, S staleness bound (rl.max_staleness), K global steps, R responses of a stream, O
decode-slot offsets (a write slot is P + o, o in [0, C)).

A response's length (generated tokens, the stop token included) is in [1, C], C if truncated;
after its prefill it takes that many decode steps, the (t+1)-th token's writing slot P + t.

Schedules (every decode step runs all `slots` rows of the sampler's program):
- `static` (today's sampler): B responses in passes of `slots` rows, pass i the strided rows i,
  i + n, i + 2n, … (n = B/slots, `slices.py`'s order); a pass runs max(its lengths) decode
  steps, every row writing slot P + j at step j, finished rows idling in their slots.
- `continuous` (sampling.continuous): a queue of the B responses in row order; the first `slots`
  fill the slots (one batched prefill); an iteration is one decode step of every slot, after
  which finished responses leave and each freed slot, in ascending order, takes the next pending
  response (a 1-row prefill of P tokens), its first token in the next iteration, until all B are
  done.
- `partial` (partial rollouts, rl.max_staleness = S ≥ 1), over K global steps of a stream of
  groups: step k tops the queue up to B + slots responses (S = 0: the step's own B, i.e.
  `continuous`); every carried response (in flight, or complete and not consumed) whose oldest
  token has version < k − S is dropped (tokens discarded, re-queued at its place); free slots
  take pending responses in queue order and every occupied slot is prefilled in one batch with
  the new parameters (the prompt and the tokens so far). Iterations as in `continuous` follow
  until at least Q groups (all G members finished) are complete, checked before the first
  iteration too (an already complete batch decodes nothing). The batch is the Q complete groups
  earliest in queue order; the rest carries to step k + 1. Tokens generated in step k have
  version k, so every consumed token's age k − version is ≤ S. A dropped response keeps its
  length (lengths belong to responses, not attempts).

Decode steps come back as `Runs`: with model.decode_block a step's attention reads the key
blocks up to its largest write slot over live rows, all its cost depends on. Between finishing
events every live response advances a slot per step, so the simulators jump event to event;
tests/pod/schedule_test.py checks them against a step-by-step reference."""
from __future__ import annotations

import dataclasses
import heapq
import json
import math

import numpy as np

# Log-normal spread when the spec gives none: a coefficient of variation of
# √(e^σ² − 1) ≈ 0.86, a right-skewed spread of the kind published RL-on-math length
# histograms show (no parameter is read from them); at mean 8,192 of a 32,768 cap it
# truncates ≈ 1.3 % of responses, at mean 16,384 ≈ 10 %.
DEFAULT_SIGMA = 0.75
SPEC_FORMS = "lognormal:mean=8192[,sigma=0.75], fixed:N or file:PATH"


def _error(spec: str, msg: str) -> ValueError:
    return ValueError(f"lengths {spec!r}: {msg} (forms: {SPEC_FORMS})")


def _number(spec: str, field: str, text: str, low: float) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > low):
        raise _error(spec, f"{field} must be a number > {low:g}, got {text!r}")
    return v


def _lognormal(spec: str, body: str, cap: int, n: int, rng) -> np.ndarray:
    """Log-normal with mean m and log-spread σ: μ = ln m − σ²/2 (so that E = e^(μ+σ²/2)
    = m), rounded up to whole tokens, a draw above the cap clipped to C (truncated)."""
    fields = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("mean", "sigma") or key in fields:
            raise _error(spec, f"unknown or repeated field {item!r}: lognormal takes mean= "
                               f"and optionally sigma=")
        fields[key] = value
    if "mean" not in fields:
        raise _error(spec, "lognormal needs mean=, e.g. lognormal:mean=8192")
    mean = _number(spec, "mean", fields["mean"], 0)
    sigma = _number(spec, "sigma", fields.get("sigma", str(DEFAULT_SIGMA)), 0)
    x = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, n)
    return np.clip(np.ceil(x), 1, cap).astype(np.int64)


def _from_file(spec: str, path: str, cap: int, n: int, rng) -> np.ndarray:
    """One length per line or a JSON list, resampled with replacement; a length above the
    cap is clipped to C (it would have been truncated there)."""
    with open(path) as f:
        text = f.read()
    try:
        values = json.loads(text)
        values = values if isinstance(values, list) else [values]
    except json.JSONDecodeError:
        values = text.split()
    try:
        arr = np.array([int(v) for v in values], np.int64)
    except (TypeError, ValueError):
        raise _error(spec, f"file {path!r} must hold whole numbers, one per line or a "
                           f"JSON list") from None
    if arr.size == 0 or arr.min() < 1:
        raise _error(spec, f"file {path!r} must hold at least one length, each >= 1")
    return np.minimum(rng.choice(arr, n, replace=True), cap)


def lengths_from_spec(spec: str, cap: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """n response lengths in [1, cap] from `spec`: `lognormal:mean=M[,sigma=S]` (σ
    DEFAULT_SIGMA unless given), `fixed:N` or `file:PATH`."""
    kind, colon, body = spec.partition(":")
    if kind == "lognormal" and colon:
        return _lognormal(spec, body, cap, n, rng)
    if kind == "file" and body:
        return _from_file(spec, body, cap, n, rng)
    if kind == "fixed" and colon:
        v = _number(spec, "N", body, 0)
        if v != int(v) or v > cap:
            raise _error(spec, f"N must be a whole number in [1, {cap}] (max_new_tokens), "
                               f"got {body!r}")
        return np.full(n, int(v), np.int64)
    raise _error(spec, "unknown form")


@dataclasses.dataclass(frozen=True)
class Runs:
    """Decode steps as runs: run r is counts[r] consecutive steps whose largest write
    slot over live rows is P + starts[r], P + starts[r] + 1, …"""

    starts: np.ndarray
    counts: np.ndarray

    @property
    def steps(self) -> int:
        return int(self.counts.sum())

    def offsets(self) -> np.ndarray:
        """Each decode step's largest write slot − P, in order."""
        if not len(self.counts):
            return np.zeros(0, np.int64)
        return np.concatenate([s + np.arange(c) for s, c in zip(self.starts, self.counts)])

    def sum_of(self, values_O: np.ndarray) -> float:
        """Σ over the decode steps of values_O[offset]: by prefix sums, a run at a time."""
        cum = np.concatenate([[0.0], np.cumsum(values_O, dtype=np.float64)])
        return float(np.sum(cum[self.starts + self.counts] - cum[self.starts]))


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One sampler run (a global step's sampling, or an evaluation). prefills: per prefilled
    row, generated tokens beyond the P prompt slots (0 fresh, t re-prefilled after t); tokens:
    generated (live slot-steps, discarded ones included); consumed_by_age: consumed tokens by
    age k − version, 0 to the oldest; batch: consumed response ids; written_O[o]: tokens
    generated writing slot P + o (Σ = tokens); dropped, queue (queued after the top-up): partial
    rollouts only; shared_slot: all rows write the step's one slot (static passes: a finished
    row keeps its place and reads), else each its own (a free slot reads only its prompt's)."""

    runs: Runs
    prefills: np.ndarray
    tokens: int
    slots: int
    dropped: int = 0
    consumed_by_age: np.ndarray | None = None
    queue: int = 0
    batch: np.ndarray | None = None
    written_O: np.ndarray | None = None
    shared_slot: bool = False

    @property
    def occupancy(self) -> float:
        """Share of slot-steps that held a live response."""
        return self.tokens / max(1, self.runs.steps * self.slots)

    def prefill_tokens(self, prompt_slots: int) -> int:
        return int(len(self.prefills) * prompt_slots + self.prefills.sum())


def _slots(b: int, slots: int) -> int:
    slots = slots or b
    if slots <= 0 or b % slots:
        raise ValueError(f"sampling.max_batch: {b} responses must split into passes of "
                         f"{slots} rows (a divisor of B, or 0 for all at once)")
    return slots


def static(lengths_B: np.ndarray, slots: int) -> Sampling:
    """Passes of `slots` strided rows (module docstring); slots 0: one pass of all B."""
    b = len(lengths_B)
    n = b // _slots(b, slots)
    steps = np.array([lengths_B[i::n].max() for i in range(n)], np.int64)
    tokens = int(lengths_B.sum())
    written_O = b - np.cumsum(np.bincount(lengths_B))[:-1]  # rows longer than o
    return Sampling(Runs(np.zeros(n, np.int64), steps), np.zeros(b, np.int64), tokens,
                    b // n, consumed_by_age=np.array([tokens]), batch=np.arange(b),
                    written_O=written_O, shared_slot=True)


class _Sampler:
    """Continuous-sampler state over a response stream; `step` samples one global step."""

    def __init__(self, lengths_R, group: int, slots: int, steps: int):
        r = len(lengths_R)
        self.length, self.group, self.slots = np.asarray(lengths_R, np.int64), group, slots
        self.gen = np.zeros(r, np.int64)          # tokens generated (current attempt)
        self.version = np.full(r, -1, np.int64)   # version of the oldest token; -1 none
        self.by_version = np.zeros((r, steps), np.int64)  # tokens of each version
        # 0 unqueued, 1 pending, 2 live (in a slot), 3 done (not consumed), 4 consumed
        self.state = np.zeros(r, np.int8)
        self.done_in = np.zeros(-(-r // group), np.int64)  # finished members per group
        self.slot = np.full(slots, -1, np.int64)  # response in each slot, -1 free
        self.pending: list[int] = []              # heap: queue order = response id
        self.next = 0                             # the stream's next response

    def _fill(self, prefills: list) -> None:
        for s in np.flatnonzero(self.slot < 0):
            if not self.pending:
                return
            r = heapq.heappop(self.pending)
            self.slot[s], self.state[r] = r, 2
            prefills.append(0)

    def step(self, k: int, queue_to: int, staleness: int, groups: int) -> Sampling:
        st = self.state
        queued = int(np.count_nonzero((st >= 1) & (st <= 3)))
        while queued < queue_to:
            if self.next == len(st):
                raise ValueError(f"the stream's {len(st)} responses ran out at step {k}")
            st[self.next] = 1
            heapq.heappush(self.pending, self.next)
            self.next, queued = self.next + 1, queued + 1
        stale = np.flatnonzero((st >= 2) & (st <= 3) & (self.version >= 0)
                               & (self.version < k - staleness))
        for r in stale:
            if st[r] == 3:
                self.done_in[r // self.group] -= 1
            self.slot[self.slot == r] = -1
            st[r], self.gen[r], self.version[r], self.by_version[r] = 1, 0, -1, 0
            heapq.heappush(self.pending, r)
        prefills = [int(self.gen[r]) for r in self.slot[self.slot >= 0]]  # re-prefills
        self._fill(prefills)
        starts, counts, tokens = [], [], 0
        written = np.zeros(self.length.max() + 1, np.int64)  # differences over o
        complete = lambda: np.flatnonzero(self.done_in == self.group)
        while len(complete()) < groups:
            live = self.slot[self.slot >= 0]
            if not len(live):
                raise ValueError(f"step {k}: every queued response finished with fewer "
                                 f"than {groups} complete groups (slots must hold whole "
                                 f"groups: queue B + slots responses)")
            left = self.length[live] - self.gen[live]
            dt = int(left.min())  # steps until the next response finishes
            starts.append(int(self.gen[live].max()))
            counts.append(dt)
            tokens += dt * len(live)
            np.add.at(written, self.gen[live], 1)
            np.add.at(written, self.gen[live] + dt, -1)
            self.version[live[self.version[live] < 0]] = k
            self.gen[live] += dt
            self.by_version[live, k] += dt
            ended = left == dt
            st[live[ended]] = 3
            np.add.at(self.done_in, live[ended] // self.group, 1)
            self.slot[np.flatnonzero(self.slot >= 0)[ended]] = -1
            self._fill(prefills)
        batch = complete()[:groups]
        rows = (batch[:, None] * self.group + np.arange(self.group)).ravel()
        st[rows] = 4
        self.done_in[batch] = -1  # consumed: never complete again
        per_version = self.by_version[rows, :k + 1].sum(axis=0)
        return Sampling(Runs(np.array(starts, np.int64), np.array(counts, np.int64)),
                        np.array(prefills, np.int64), tokens, self.slots,
                        dropped=len(stale),
                        consumed_by_age=np.trim_zeros(per_version[::-1], "b"),
                        queue=queued, batch=rows, written_O=np.cumsum(written)[:-1])


def continuous(lengths_B: np.ndarray, slots: int) -> Sampling:
    """`continuous` of the module docstring; slots 0: B slots (then it equals a static pass)."""
    b = len(lengths_B)
    slots = slots or b
    return _Sampler(lengths_B, 1, slots, 1).step(0, b, 0, b)


def partial(lengths_R: np.ndarray, batch: int, group: int, slots: int, staleness: int,
            steps: int) -> list[Sampling]:
    """K = `steps` global steps of `partial` rollouts (module docstring) over the stream
    lengths_R (response r in group r // G; ≥ K·B + slots), B = `batch`: a Sampling per step."""
    if batch % group:
        raise ValueError(f"rl.group_size: B = {batch} must be a multiple of G = {group}")
    slots = slots or batch
    queue_to = batch + slots if staleness else batch
    sampler = _Sampler(lengths_R, group, slots, steps)
    return [sampler.step(k, queue_to, staleness, batch // group) for k in range(steps)]
