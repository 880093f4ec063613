"""A workdir's history: what a run left there, kept unless a resume continues it or the user asks
to replace it.

History is every file a run writes: the step-keyed logs (metrics.jsonl, minibatches.jsonl,
samples.jsonl, attribution.jsonl), summary.json, plots/, TensorBoard's tb/, trackers.json,
profile/ and the export (`--export-hf`). A start with no checkpoint to resume from rewrites them,
so it may start only over a short history: no log past step 2 · `rl.checkpoint_every` (rows
precede their step's save and saves wait for the one before, so the save of step
`checkpoint_every` had completed; past step 0 if the run never checkpoints), no summary.json or
plots (a finished run), no export. Else it is refused in one line naming `--replace-history`; the
flag moves the history into `<workdir>/replaced.<n>/` (the export to `<export>.replaced.<n>`), in
one warning; nothing is deleted.

"A checkpoint to resume from" is decided twice: before any work (`check`, before the cold start),
a committed step of this run named by its step record (`checkpoint_steps.resumable_steps`; not
stray files, other programs' folders, `<step>.corrupt` or `<step>.unusable`); then by restoring
(`after_restore`, in the loop): a run whose every step failed to restore is refused alike, or
replaces its history under the flag.
"""
from __future__ import annotations

import logging
import os

from stablerl_jax import distributed
from stablerl_jax.runs import storage
from stablerl_jax.runs.checkpoint_steps import resumable_steps
from stablerl_jax.runs.metrics_io import read_metrics

LOGS = ("metrics.jsonl", "minibatches.jsonl", "samples.jsonl", "attribution.jsonl")
FINISHED = ("summary.json", "plots")  # written at a run's end only
OTHERS = ("tb", "trackers.json", "profile")
FLAG = "--replace-history"


def found(cfg, workdir: str, export_hf: str = "") -> list[str]:
    """What of a run's history `workdir` and the export hold that a fresh start would replace,
    one entry per file ('metrics.jsonl: 31 rows to step 30'); [] for a short history."""
    logs, long = [], False
    for name in LOGS:
        steps = [r["step"] for r in read_metrics(os.path.join(workdir, name))]
        if steps:
            logs.append(f"{name}: {len(steps)} rows to step {max(steps)}")
            long = long or max(steps) > 2 * cfg.rl.checkpoint_every
    ended = [name for name in FINISHED if _holds(os.path.join(workdir, name))]
    ended += [f"the export {export_hf}"] * bool(export_hf and _holds(export_hf))
    return logs + ended if long or ended else []


def _holds(path: str) -> bool:
    """A file, or a directory with an entry (a link counts as there)."""
    if storage.islink(path):
        return True
    if not storage.exists(path):
        return False
    return not storage.isdir(path) or bool(storage.listdir(path))


def check(cfg, workdir: str, replace: bool = False, export_hf: str = "") -> None:
    """Before any work: refuse to start over another run's history unless `replace` moves it
    aside; a workdir with a resumable step is left to `after_restore`."""
    if resumable_steps(os.path.join(workdir, "checkpoints")):
        return
    _keep_or_move(cfg, workdir, replace, export_hf, "no checkpoint to resume it from")


def after_restore(cfg, workdir: str, replace: bool, export_hf: str = "") -> None:
    """`check`'s rule once every step failed to restore; trackers.json stays (trackers open)."""
    _keep_or_move(cfg, workdir, replace, export_hf,
                  "no checkpoint that restores (each was moved aside to <step>.corrupt or "
                  "<step>.unusable, see the log)", keep=("trackers.json",))


def _keep_or_move(cfg, workdir, replace, export_hf, why: str, keep=()) -> None:
    what = found(cfg, workdir, export_hf)
    if not what:
        return
    if not replace:
        raise ValueError(f"{workdir} holds another run's history ({', '.join(what)}) and "
                         f"{why}, so a fresh start would replace it; pass {FLAG} to move it "
                         "aside and start over there, or choose another --workdir")
    distributed.barrier("history found")  # every process read it before it moves
    if distributed.is_main():
        move_aside(workdir, export_hf, keep)
    distributed.barrier("history moved aside")


def move_aside(workdir: str, export_hf: str = "", keep=()) -> list[str]:
    """Move the history of `workdir` but `keep` into `<workdir>/replaced.<n>/` (first free n),
    the export to `<export>.replaced.<n>`; returns what moved where (also one warning)."""
    names = [n for n in (*LOGS, *FINISHED, *OTHERS)
             if n not in keep and storage.lexists(os.path.join(workdir, n))]
    moved = []
    if names:
        dest = _free(os.path.join(workdir, "replaced."))
        storage.makedirs(dest)
        for name in names:
            storage.rename(os.path.join(workdir, name), os.path.join(dest, name))
        moved.append(f"{', '.join(names)} to {dest}")
    if export_hf and _holds(export_hf):
        dest = _free(export_hf.rstrip("/") + ".replaced.")
        storage.rename(export_hf, dest)
        moved.append(f"the export {export_hf} to {dest}")
    if moved:
        logging.warning("%s: %s: moved %s", workdir, FLAG, "; ".join(moved))
    return moved


def _free(prefix: str) -> str:
    n = 1
    while storage.lexists(f"{prefix}{n}"):
        n += 1
    return f"{prefix}{n}"
