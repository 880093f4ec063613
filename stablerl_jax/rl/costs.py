"""What a run costs as it runs: wall time per phase, throughput, model FLOP/s and MFU, peak
device memory, and roofline estimates of the compiled steps beside them.

Training rows of metrics.jsonl carry (rl/loop.py marks the phases):

    time/step        seconds since the previous row (or loop start), its logs and save included
    time/sample      the sampler, every dynamic-sampling round and merge
    time/reward      decoding and scoring the completions on the host
    time/score       the π_old pass (with rl.trim_bucket, the trim before it)
    time/update      the N optimizer steps and mini-batch selection (time/update_<i>)
    time/attribution rl.attribution's probe passes; time/eval: the held-out evaluation
    time/logs        writing the previous row (metrics.jsonl, TensorBoard, trackers, logs)
    time/checkpoint  the previous row's save, the part waited for (rl.async_checkpoints)
    time/other       time/step minus the phases: host work between them
    time/compile     JAX tracing, lowering, compiling (time/compile_<phase>: per phase)

Also time/sample_per_round, time/sample_per_decode_step. No key is a path prefix of another
(`time/update`, `time/update_0`): MLflow's file store makes a metric's name a file path.

`perf/…`: generated and trained (loss) tokens / s, total and per device; decode steps / s; score
and update model FLOP/s per device (model/flops.py at the shapes run: padded rows count whole,
rematerialized forwards do not) and MFU against `peak_flops`; peak device memory
(`memory_stats()`, not on CPU).

The host waits for the device anyway after sampling, each update and the evaluation (it reads
their results); after scoring it waits (`jax.block_until_ready`) only under rl.phase_sync
(default), else scoring still running lands in time/update.

With chip constants (roofline.CHIP_SPECS: TPU v4 / v5e / v5p / v6e, NVIDIA H100 / H200; not CPU)
the run compiles its sample, score and update programs once at the start and prices them with
`roofline.estimate` (as experiments.aot_compile prints). Rows log `est/<phase>`, scaled to the
step's shapes (sample by decode steps / max_new_tokens, score and update by model FLOPs), and
`perf/<phase>_vs_est` = measured / estimated.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import jax
import numpy as np

from stablerl_jax import distributed
from stablerl_jax.model.flops import forward_flops, train_flops
from stablerl_jax.pod import aot, roofline
from stablerl_jax.pod.aot import score_forwards

# The events JAX records while it makes a program (jax/_src/dispatch.py).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
PHASES = ("sample", "reward", "score", "update", "attribution", "eval", "logs", "checkpoint")

# A stated CPU figure: 32 float32 FLOP per cycle and core (two 256-bit FMA pipes) at
# 2.5 GHz, shared by the CPU devices of the process. The chips' peaks are roofline's.
CPU_FLOPS_PER_CORE = 32 * 2.5e9


def chip_key(device) -> str | None:
    """The roofline.CHIP_SPECS key of a JAX device (by its device_kind), or None."""
    kind = device.device_kind.lower()
    for needle, key in (("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"),
                        ("v6e", "v6e"), ("v5p", "v5p"), ("tpu v5", "v5p"), ("v4", "v4"),
                        ("h100", "h100"), ("h200", "h200")):
        if needle in kind:
            return key
    return None


def peak_flops(device) -> tuple[float, str]:
    """(peak bf16 FLOP/s of one device, where the figure comes from)."""
    key = chip_key(device)
    if key is not None:
        spec = roofline.CHIP_SPECS[key]
        return spec.peak_flops, spec.source
    if device.platform == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        per_device = cores * CPU_FLOPS_PER_CORE / max(1, jax.local_device_count("cpu"))
        return per_device, (f"CPU: {cores} cores × 32 float32 FLOP/cycle × 2.5 GHz, "
                            "an assumed figure")
    return math.nan, f"{device.device_kind}: no peak known"


class PhaseTimer:
    """Accumulates wall and compile seconds per phase until `row()` hands them over."""

    def __init__(self, sync: bool = True):
        self.sync = sync
        self.times: dict[str, float] = {}
        self.compile: dict[str, float] = {}
        self._phase = "other"
        self._row_start = time.perf_counter()

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if event in COMPILE_EVENTS:
            self.compile[self._phase] = self.compile.get(self._phase, 0.0) + duration

    @contextlib.contextmanager
    def phase(self, name: str, key: str | None = None):
        """Time the block as phase `name` (accumulated; `key`: also as time/<key>)."""
        outer, self._phase = self._phase, name
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.times[name] = self.times.get(name, 0.0) + dt
            if key:
                self.times[key] = self.times.get(key, 0.0) + dt
            self._phase = outer

    def wait(self, tree):
        """Block until `tree`'s arrays are computed (under rl.phase_sync)."""
        if self.sync:
            jax.block_until_ready(tree)
        return tree

    def row(self) -> dict:
        """The `time/…` of the row being written; the next row starts now."""
        now = time.perf_counter()
        step = now - self._row_start
        out = {f"time/{k}": v for k, v in self.times.items()}
        out["time/step"] = step
        out["time/other"] = step - sum(self.times.get(p, 0.0) for p in PHASES)
        out["time/compile"] = sum(self.compile.values())
        out.update({f"time/compile_{k}": v for k, v in self.compile.items() if v})
        self.times, self.compile, self._row_start = {}, {}, now
        return out


def device_memory_gib() -> float | None:
    """Largest peak memory in use over this process's devices, GiB; None where unreported."""
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 2**30 if peaks else None


def step_flops(cfg, rows: int, width: int) -> dict:
    """Model FLOPs of the score pass and of the N updates: `rows` responses, `width` slots."""
    t = width - 1
    score = forward_flops(cfg.model, rows, t) * score_forwards(cfg)
    return {"score": score, "update": train_flops(cfg.model, rows, t)}


def perf_row(cfg, times: dict, *, generated: float, trained: float, rows: int, width: int,
             decode_steps: float | None, estimates: dict | None = None) -> dict:
    """`perf/…` and `est/…` of a row from its `time/…` and the step's work: tokens generated
    (every round) and trained (loss), rows, slot width, decode steps (None: unknown)."""
    n = jax.device_count()
    peak, _ = peak_flops(jax.devices()[0])
    sample_s, update_s = times.get("time/sample", 0.0), times.get("time/update", 0.0)
    out = {}
    if sample_s > 0:
        out["perf/generated_tokens_per_s"] = generated / sample_s
        out["perf/generated_tokens_per_s_per_device"] = generated / sample_s / n
        if decode_steps is not None:
            out["perf/decode_steps_per_s"] = decode_steps / sample_s
    if update_s > 0:
        out["perf/trained_tokens_per_s"] = trained / update_s
        out["perf/trained_tokens_per_s_per_device"] = trained / update_s / n
    flops = step_flops(cfg, rows, width)
    for phase in ("score", "update"):
        s = times.get(f"time/{phase}", 0.0)
        if s > 0 and flops[phase] > 0:  # a score step without a forward has no MFU
            per_device = flops[phase] / s / n
            out[f"perf/{phase}_flops_per_s_per_device"] = per_device
            out[f"perf/{phase}_mfu"] = per_device / peak
    mem = device_memory_gib()
    if mem is not None:
        out["perf/peak_memory_gib"] = mem
    if estimates:
        compiled_width = cfg.task.max_prompt_len + cfg.sampling.max_new_tokens
        full = step_flops(cfg, rows, compiled_width)
        scale = {"sample": (decode_steps or cfg.sampling.max_new_tokens)
                 / (cfg.sampling.max_new_tokens * _passes(cfg, rows)),
                 "score": flops["score"] / full["score"] if full["score"] else 1.0,
                 "update": flops["update"] / full["update"]}
        for phase, seconds in estimates.items():
            est = seconds * scale[phase]
            out[f"est/{phase}"] = est
            if times.get(f"time/{phase}", 0.0) > 0:
                out[f"perf/{phase}_vs_est"] = times[f"time/{phase}"] / est
    return out


def _passes(cfg, rows: int) -> int:
    return rows // cfg.sampling.max_batch if cfg.sampling.max_batch else 1


def estimate_phases(engine) -> tuple[dict | None, str]:
    """({phase: estimated seconds} or None, what was done): the engine's steps compiled for its
    own devices, priced by roofline.estimate at the compiled shapes (process 0 only)."""
    device = engine.mesh.devices.flat[0]  # the engine's own: abstract ones for a dry start
    key = chip_key(device)
    if key is None:
        return None, (f"estimates: none on {device.device_kind} (no chip constants "
                      "in roofline.CHIP_SPECS); perf/…_vs_est not logged")
    if not distributed.is_main():
        return None, ""
    chip = roofline.CHIP_SPECS[key]
    compiled = {n: aot.compile_step(engine, n) for n in ("sample", "score", "update")}
    est = roofline.estimate(engine, compiled, chip).steps
    phases = {"sample": est["sample"].seconds, "score": est["score"].seconds,
              "update": est["update"].seconds * engine.cfg.rl.num_minibatches}
    return phases, (f"estimates ({key}: {chip.source}): "
                    + ", ".join(f"{k} {v:.3g} s" for k, v in phases.items()))


def measured_vs_estimated(records: list[dict]) -> list[tuple[str, float, float, float]]:
    """(phase, mean measured s, mean estimated s, ratio) over the rows that have both."""
    out = []
    for phase in ("sample", "score", "update"):
        pairs = [(r[f"time/{phase}"], r[f"est/{phase}"]) for r in records
                 if r.get(f"est/{phase}") and r.get(f"time/{phase}")]
        if pairs:
            m, e = (float(np.mean(x)) for x in zip(*pairs))
            out.append((phase, m, e, m / e))
    return out


def time_split(records: list[dict], skip: int = 1) -> dict:
    """Mean seconds per step (time/step, each phase, time/other) after the first `skip` rows."""
    rows = [r for r in records if r.get("time/step") is not None and r.get("step", 0) > 0]
    rows = rows[skip:] if len(rows) > skip else rows
    if not rows:
        return {}
    return {k: float(np.mean([r.get(f"time/{k}", 0.0) for r in rows]))
            for k in ("step", *PHASES, "other")}


def derived_times(times: dict, metrics: dict, work: dict) -> dict:
    """Per-round and per-decode-step sampler seconds, where they apply."""
    out = {}
    sample_s = times.get("time/sample", 0.0)
    if metrics.get("dynamic/rounds"):
        out["time/sample_per_round"] = sample_s / metrics["dynamic/rounds"]
    if work.get("decode_steps"):
        out["time/sample_per_decode_step"] = sample_s / work["decode_steps"]
    return out


def cost_table(summary: dict) -> str:
    """End-of-run table: seconds per step, its split, measured vs estimated (or why not)."""
    split = summary.get("cost", {}).get("seconds_per_step") or {}
    if not split:
        return "cost: no training rows"
    lines = [f"seconds per global step {split['step']:.3g} (mean over the rows after the "
             "first): " + ", ".join(f"{k} {v:.3g}" for k, v in split.items()
                                    if k != "step" and v > 0)]
    pairs = summary["cost"].get("measured_vs_estimated") or []
    if pairs:
        lines.append("| phase | measured s | estimated s | measured / estimated |\n"
                     "|---|---|---|---|")
        lines += [f"| {p['phase']} | {p['measured_s']:.3g} | {p['estimated_s']:.3g} | "
                  f"{p['ratio']:.2f} |" for p in pairs]
    else:
        lines.append(f"no estimates on {jax.devices()[0].device_kind}: the chip constants "
                     "of roofline.CHIP_SPECS are TPU v4 / v5e / v5p / v6e and H100 / H200")
    return "\n".join(lines)
