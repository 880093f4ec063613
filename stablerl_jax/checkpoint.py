"""Checkpoints with orbax: atomic, optionally async, keep-N, resume from the latest
*complete* step only.

Orbax writes each step into a temporary directory and renames it into place when the
write has finished, so a run killed mid-save leaves a temporary directory that is never
listed as a step: resume can only ever see complete checkpoints.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def _abstract(tree):
    """Shape/dtype/sharding targets, so a restore lands on the live state's devices."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=getattr(x, "sharding", None)),
                        tree)


class Checkpointer:
    """Per-step {'state': pytree of arrays, 'meta': small JSON dict}."""

    def __init__(self, directory: str, keep: int = 2, async_: bool = True):
        directory = os.path.abspath(directory)
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"checkpoint directory {directory!r} is a file; pass a directory")
        self.manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_, create=True))
        self.directory = directory

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int | None, target_state):
        """(state, meta) of `step` (default: latest), restored onto target's shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no complete checkpoint in {self.directory!r}; start a fresh run "
                             "or point to another workdir")
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target_state)),
                meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {self.directory}/{step} does not match this run's "
                             f"state (different model or optimizer config?): {e}") from None
        return out.state, out.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def save_params(path: str, params) -> None:
    """Save one params pytree to `path` (atomically; the directory must not exist)."""
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(path), params)
    ckpt.wait_until_finished()


def load_params(path: str, target):
    """Load params saved by `save_params`; `target` gives structure, shapes and dtypes."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"no params checkpoint at {path!r}")
    return ocp.StandardCheckpointer().restore(path, _abstract(target))
