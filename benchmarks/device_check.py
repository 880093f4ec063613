"""The checks a lent GPU (an H100 or H200) is for, in one command and one report.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m benchmarks.device_check \
        [--out DIR] [--budget-s 480]

Each part runs as a child process under its share of the budget, its output kept:

1. `env`: jax's version, backend and devices.
2. `kernels`: the kernel tests and the model's batch-invariance tests, compiled for the
   device (tests/kernels, tests/model/invariant_test.py; the tests that need the data
   stack left out: the device image lacks it).
3. `bits-float32`, `bits-bfloat16`: experiments.bitwise_check; exit 0 means the sampler
   computed the trainer's log-probs, experts and gate weights bit for bit.
4. `cost`: benchmarks.bitwise_cost --model-only at the long task's shape (128 rows of
   16 + 320 tokens, bfloat16): `bitwise` against `exact`, per hop.

Without a GPU, parts 2 and 4 are recorded as skipped, with the reason: on a CPU the
kernels run interpreted in the default test tier, and CPU costs have their own
benchmark. Part 3 then runs at a CPU size. The report is DIR/device_check.md (a table of
part, exit status, seconds and verdict, then each part's command and output tail) and
DIR/device_check.json. DIR defaults to $OUT where that is set, else
runs/device_check. Exit status 0 when every part that ran passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import NamedTuple

ENV = ("import jax; print('jax', jax.__version__, 'backend', jax.default_backend());"
       " print('devices', jax.devices())")
TESTS = ("tests/kernels", "tests/model/invariant_test.py")
# Tests that build a tokenizer or a data set, which the device image cannot.
NEEDS_DATA = "not hugging and not bitwise_run and not check_command"


class Part(NamedTuple):
    name: str
    argv: tuple[str, ...]
    share: float          # of the budget
    gpu_only: bool
    cpu_argv: tuple[str, ...] = ()  # the CPU-size command, where it differs


def parts() -> tuple[Part, ...]:
    py = sys.executable
    bits = lambda dtype, rows, tokens: (py, "-m", "experiments.bitwise_check", "--rows",
                                        str(rows), "--new-tokens", str(tokens),
                                        f"model.compute_dtype={dtype}")
    return (
        Part("env", (py, "-c", ENV), 0.05, False),
        Part("kernels", (py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "",
                         "-k", NEEDS_DATA, *TESTS), 0.40, True),
        Part("bits-float32", bits("float32", 16, 16), 0.12, False, bits("float32", 4, 6)),
        Part("bits-bfloat16", bits("bfloat16", 16, 16), 0.12, False, bits("bfloat16", 4, 6)),
        Part("cost", (py, "-m", "benchmarks.bitwise_cost", "--model-only", "--preset", "long",
                      "--rows", "128", "--prompt-len", "16", "--new-tokens", "320",
                      "--steps", "3", "model.compute_dtype=bfloat16"), 0.31, True),
    )


def has_gpu() -> tuple[bool, str]:
    """(whether jax sees a GPU, the backend it sees), asked in a child process so that
    this one never initializes a backend."""
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                         capture_output=True, text=True, timeout=120)
    backend = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"
    return backend in ("gpu", "cuda", "rocm"), backend


def run_part(part: Part, gpu: bool, limit_s: float) -> dict:
    argv = part.argv if gpu or not part.cpu_argv else part.cpu_argv
    t0 = time.perf_counter()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:  # its output may come back as bytes
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                       for x in (e.stdout, e.stderr)) + "\n(stopped at its limit)"
        rc = None
    seconds = time.perf_counter() - t0
    verdict = ("timed out" if rc is None else "passed" if rc == 0 else
               "differs" if part.name.startswith("bits") and rc == 1 else "failed")
    return {"part": part.name, "command": " ".join(argv), "rc": rc, "limit_s": round(limit_s),
            "seconds": round(seconds, 1), "verdict": verdict, "tail": text[-4000:]}


def report(rows: list[dict], backend: str) -> str:
    lines = [f"# device_check (backend {backend})", "",
             "| part | exit | seconds | limit s | verdict |", "|---|---|---|---|---|"]
    lines += [f"| {r['part']} | {r['rc'] if r['rc'] is not None else '—'} | {r['seconds']} | "
              f"{r['limit_s']} | {r['verdict']} |" for r in rows]
    for r in rows:
        lines += ["", f"## {r['part']}", "", f"    {r['command']}", "", "```",
                  r["tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/device_check")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="seconds for all parts together (each gets its share)")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s={args.budget_s:g}: give a positive number of seconds, e.g. 480")
    if "://" in args.out:  # plain files: the device image has no Cloud Storage client
        ap.error(f"--out={args.out}: give a local directory (copy the report to a bucket after)")
    os.makedirs(args.out, exist_ok=True)
    gpu, backend = has_gpu()
    rows = []
    for part in parts():
        if part.gpu_only and not gpu:
            why = (f"no GPU (jax backend {backend}): on a CPU the kernels run interpreted in "
                   "the default test tier" if part.name == "kernels" else
                   f"no GPU (jax backend {backend}): CPU costs are benchmarks.bitwise_cost's "
                   "own table")
            rows.append({"part": part.name, "command": " ".join(part.argv), "rc": None,
                         "limit_s": 0, "seconds": 0.0, "verdict": f"skipped: {why}",
                         "tail": ""})
            continue
        print(f"device_check: {part.name} (limit {part.share * args.budget_s:.0f} s)",
              flush=True)
        rows.append(run_part(part, gpu, part.share * args.budget_s))
        print(f"device_check: {part.name} {rows[-1]['verdict']} in {rows[-1]['seconds']} s",
              flush=True)
    md = os.path.join(args.out, "device_check.md")
    with open(md, "w") as f:
        f.write(report(rows, backend))
    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump({"backend": backend, "parts": rows}, f, indent=1)
    print(f"device_check: report in {md}", flush=True)
    return 0 if all(r["verdict"] in ("passed",) or r["verdict"].startswith("skipped")
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
