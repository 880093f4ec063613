"""Supervised cold start: cross-entropy on the cold-start data's trained tokens
(`step_fns.sft_loss`; data and loss mask: data/sft_data.py), through RL's Engine (mesh-sharded,
state donated, non-finite updates skipped) with `cfg.sft.optim` and the same model, forward and
fused log-prob op, so the cold-start policy is exactly the policy RL starts from.

It starts from a fresh init or given parameters (a Hugging Face checkpoint,
`experiments.train --hf`, as float32 master weights). In a workdir it logs
`<workdir>/sft_run/metrics.jsonl` (and to its trackers: TensorBoard unless left out, wandb /
MLflow when asked, continued on resume via `<workdir>/sft_run/trackers.json`), saves its state
every `sft.checkpoint_every` steps to `<workdir>/sft_run/checkpoints` (a killed cold start
resumes there, drawing the batches it would have) and the final parameters to `<workdir>/sft`,
reused when present.
"""
from __future__ import annotations

import json
import logging
import os

import jax
from tqdm import tqdm

from stablerl_jax import distributed
from stablerl_jax.config import ExperimentConfig, flat_dict
from stablerl_jax.data import sft_data
from stablerl_jax.method.diagnostics import reduce_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine
from stablerl_jax.rl.step_fns import TrainState, count_skips, skipped
from stablerl_jax.runs import lock, storage
from stablerl_jax.runs.checkpoint import (
    Checkpointer,
    is_complete,
    load_params,
    save_params,
)
from stablerl_jax.runs.checkpoint_steps import set_aside
from stablerl_jax.runs.metrics_io import MetricsWriter, read_metrics
from stablerl_jax.runs.trackers import Trackers


def sft_engine(cfg, data, devices=None) -> Engine:
    return Engine.create(cfg, eos_id=data.tokenizer.eos_id, pad_id=data.tokenizer.pad_id,
                         optim=cfg.sft.optim, total_steps=cfg.sft.steps, devices=devices)


def train_sft(cfg, data, *, init_params=None, workdir: str = "", init: str = "",
              progress: bool = True, devices=None, tracker: Trackers | None = None):
    """SFT for cfg.sft.steps from `init_params` (None: init from sft.seed): (params, losses).
    With `workdir`: logs, checkpoints and resumes there; `tracker`: the caller's (None:
    TensorBoard); `init` names the start in checkpoint metadata (no resume from another)."""
    examples = sft_data.load(cfg, data).examples
    engine = sft_engine(cfg, data, devices)
    if init_params is None:
        init_params = tf.init_params(jax.random.key(cfg.sft.seed), cfg.model)
    state = engine.init_state(init_params)
    run_dir = os.path.join(workdir, "sft_run") if workdir else ""
    every = cfg.sft.checkpoint_every if run_dir else 0
    ckpt = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=1) if every else None
    tracker = tracker or Trackers(("tensorboard",), run_dir, enabled=False)
    writer = MetricsWriter(run_dir, enabled=bool(run_dir) and distributed.is_main(),
                           tensorboard=tracker.tensorboard)
    meta = {"settings": {**sft_settings(cfg), "init": init}}
    start = 0
    try:
        if ckpt is not None:
            restored = ckpt.restore_latest(state._asdict(), check_meta=lambda m: _same(
                m.get("settings", {}), meta["settings"], ckpt.directory,
                "delete it to train the cold start again"))
            if restored is not None:
                start, state_dict, _ = restored
                state = TrainState(**state_dict)
        writer.truncate_after(start)
        tracker.log_config(flat_dict(cfg))
        tok, task = data.tokenizer, cfg.task
        batches = sft_data.batches(examples, cfg.sft.batch_size, cfg.sft.seed, tok.pad_id,
                                   task.max_prompt_len, task.max_solution_len, start)
        bar = tqdm(range(start, cfg.sft.steps), initial=start, total=cfg.sft.steps,
                   disable=not (progress and distributed.is_main()), desc="sft")
        skips = 0
        losses = [r["sft/loss"] for r in read_metrics(writer.path)] if run_dir else []
        for step in bar:
            lock.check_held()  # a run whose lock was taken over stops here
            state, metrics = engine.sft_update(state, next(batches))
            metrics = jax.tree.map(distributed.host, metrics)
            skips = count_skips(skips, [skipped(metrics)], cfg.sft.max_consecutive_skips,
                                "sft")
            row = {k: v for k, v in reduce_metrics([metrics]).items() if k.startswith("sft/")}
            losses.append(row["sft/loss"])
            tracker.log(step + 1, writer.write(step + 1, row))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if every and ((step + 1) % every == 0 and step + 1 < cfg.sft.steps):
                writer.flush()  # the log first: it covers every checkpoint (storage.py)
                ckpt.save(step + 1, state._asdict(), {"step": step + 1, **meta})
    except KeyboardInterrupt:  # Ctrl-C: stop bounds the wait for the save in flight
        if ckpt is not None:
            ckpt.stop()
        raise
    finally:
        if ckpt is not None:
            try:
                ckpt.wait()
            finally:
                ckpt.close()
        writer.close()
    return state.params, losses


def _same(saved: dict, wanted: dict, where: str, fix: str) -> None:
    """Refuse to reuse or resume a cold start made with other settings (`where` holds it, `fix`
    says how to redo it); a setting the saved record lacks counts as its default."""
    defaults = {**sft_settings(ExperimentConfig()), "init": ""}
    changed = sorted(k for k in set(saved) | set(wanted) if k not in _SFT_RUN_FIELDS
                     and saved.get(k, defaults.get(k)) != wanted.get(k, defaults.get(k)))
    if changed:
        raise ValueError(f"{where} was trained with other settings ({', '.join(changed[:8])});"
                         f" {fix}, or use another workdir")


# The settings that determine the cold-start parameters (compared when they are reused),
# less those that change how a step computes or how long a run may misbehave, not what
# it learns (remat, expert paths, micro-batching, the skip limit).
_SFT_SECTIONS = ("model.", "task.", "sft.")
_SFT_RUN_FIELDS = ("model.remat", "model.dispatch", "model.moe_tile", "model.gmm_impl",
                   "model.expert_parallel", "model.attention_impl", "model.attention_chunk",
                   "model.unroll_layers", "model.kv_cache_layout", "model.decode_block",
                   "sft.microbatches", "sft.checkpoint_every",
                   "sft.max_consecutive_skips")


def sft_settings(cfg) -> dict:
    """The flat settings a cold start is stored with and compared on (`<workdir>/sft.json`)."""
    return {k: v for k, v in flat_dict(cfg).items()
            if k.startswith(_SFT_SECTIONS) and k not in _SFT_RUN_FIELDS}


def cold_start(cfg, data, workdir: str, *, init_params=None, init: str = "",
               progress: bool = True, devices=None, trackers=("tensorboard",)):
    """(parameters RL starts from, SFT losses or None): `init_params` when sft.steps = 0; else
    `<workdir>/sft` if complete; else SFT from `init_params` (None: fresh init; a function is
    called only if needed; `init` names them, e.g. the --hf path), saved there with its settings
    (`<workdir>/sft.json`): reuse with other model / task / SFT settings or start is refused. A
    directory without its commit marker (a killed save) is moved aside and trained again (from
    the last SFT checkpoint). `trackers`: SFT metric sinks besides sft_run/metrics.jsonl
    (trackers.NAMES). Multi-process, every process calls this (the workdir is shared)."""
    if not cfg.sft.steps:
        init_params = init_params() if callable(init_params) else init_params
        if init_params is None:
            init_params = tf.init_params(jax.random.key(cfg.rl.seed), cfg.model)
        return init_params, None
    path = os.path.join(storage.abspath(workdir), "sft")
    config_path = path + ".json"
    wanted = {**sft_settings(cfg), "init": init}
    if distributed.is_main() and storage.isdir(path) and not is_complete(path):
        logging.warning("%s was not completely written; moved to %s and training again",
                        path, set_aside(path, ".incomplete"))
    distributed.barrier("sft directory")
    if storage.isdir(path):
        if storage.exists(config_path):
            try:
                saved = json.loads(storage.read_text(config_path))
            except ValueError as e:
                raise ValueError(
                    f"{config_path}: not valid JSON ({e}); delete it and {path} to "
                    "train the cold start again, or use another workdir") from None
            _same(saved, wanted, path, f"delete {path} and {config_path} to train it again")
        # Each process reads the whole of every array (the Engine shards them afterwards).
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=here),
                            jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg.model)))
        return load_params(path, like), None
    if callable(init_params):
        init_params = init_params()
    with Trackers(trackers, os.path.join(workdir, "sft_run"), run_name=f"{cfg.name}/sft",
                  enabled=distributed.is_main()) as tracker:
        params, losses = train_sft(cfg, data, init_params=init_params, workdir=workdir,
                                   init=init, progress=progress, devices=devices,
                                   tracker=tracker)
    # The settings first: a kill between the two leaves an incomplete sft/ (set aside and
    # trained again), never a complete one without its settings.
    if distributed.is_main():
        storage.atomic_write(config_path, json.dumps(wanted, indent=1))
    save_params(path, params)
    distributed.barrier("sft saved")
    if distributed.is_main():  # the final parameters supersede the SFT checkpoints
        try:
            storage.rmtree(os.path.join(storage.abspath(workdir), "sft_run", "checkpoints"))
        except OSError:  # only space is lost: a later cold start trains from sft/
            pass
    return params, losses
