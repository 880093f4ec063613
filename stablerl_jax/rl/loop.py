"""The global-step loop (docs/method.md §1), with eval, checkpoints and logs.

Letters: G responses per prompt, B = rl.prompts_per_step × G, N mini-batches of M = B/N.

One global step, each hop a call into one module and back:

    1–3. rl.sources   the step's `Responses`: prompts (data.task), the rollout (rl.engine
                      sample(θ_old): tokens, logp_mu, routes_mu) and rewards, or dynamic
                      rounds, partial rollouts, an offline file
    4. rl.engine      score(θ_old): advantages, log π_old, the replay tensor, monitors (on
                      the rollout cut to the slots in use under rl.trim_bucket)
    5. rl.engine      N × select + update(θ): one optimizer step per seeded mini-batch
    6. diagnostics    reduce_metrics: the step's monitors as floats
    7. metrics_io     the metrics row (avg@k per eval set every eval_every steps,
                      rl/evals.py), samples.jsonl; both to runs/trackers.py (wandb, MLflow)

Everything random derives from (seed, step): a run resumed from its last complete checkpoint
reproduces the uninterrupted run bit for bit on CPU. The workdir may be local or `gs://`
(storage.py); JSONL logs are flushed before each checkpoint save, so they cover every checkpoint
(on an object store rows upload whole then; a kill loses only rows the resume writes again).
"""
from __future__ import annotations

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from stablerl_jax import distributed, packing
from stablerl_jax.config import flat_dict
from stablerl_jax.data.task import TaskData
from stablerl_jax.interop.hf_export import save_qwen3_moe
from stablerl_jax.interop.rollouts import OfflineRollouts
from stablerl_jax.method import attribution, overlong
from stablerl_jax.method.diagnostics import reduce_metrics
from stablerl_jax.model import transformer as tf
from stablerl_jax.model.numerics import dtype_of
from stablerl_jax.rl import (
    costs,
    dynamic,
    evals,
    preflight,
    probe,
    profiling,
    resume,
    sources,
    step_fns,
)
from stablerl_jax.rl import history as workdir_history
from stablerl_jax.rl.engine import Engine
from stablerl_jax.runs import lock, storage
from stablerl_jax.runs.checkpoint import Checkpointer
from stablerl_jax.runs.metrics_io import (
    JsonlLog,
    MetricsWriter,
    plot_metrics,
    read_metrics,
)
from stablerl_jax.runs.trackers import Trackers


def minibatch_order(seed: int, step: int, responses: int) -> np.ndarray:
    """The seeded permutation that splits a step's responses into mini-batches."""
    return np.random.default_rng([seed, step, 1]).permutation(responses)


def minibatches_of(engine: Engine, batch: step_fns.TrainBatch, step: int) -> np.ndarray:
    """[N, M] seeded mini-batch rows; under rl.pack_tokens token-balanced per batch shard."""
    rl = engine.cfg.rl
    order = minibatch_order(rl.seed, step, rl.prompts_per_step * rl.group_size)
    minibatches = order.reshape(rl.num_minibatches, -1)
    if rl.pack_tokens:  # each batch shard packs its own rows: give them equal tokens
        tokens_B = engine.row_tokens(batch)
        minibatches = np.stack([packing.balance_rows(rows, tokens_B[rows],
                                                     step_fns.batch_shards(engine.cfg))
                                for rows in minibatches])
    return minibatches


def step_metrics(cfg, every: sources.HostRows, source_metrics: dict, score_metrics,
                 update_metrics) -> dict:
    """The step's metrics row: rewards and lengths of `every` response, then all monitors."""
    metrics = {"reward": float(np.mean(every.rewards)),
               "response_length": float(np.mean(every.lengths)),
               **overlong.response_stats(every.lengths, every.truncated,
                                         cfg.sampling.max_new_tokens)}
    if cfg.rl.overlong == "penalty":
        metrics["reward/overlong_penalty"] = float(np.mean(every.penalty))
    metrics.update(source_metrics)
    metrics.update(reduce_metrics([jax.tree.map(distributed.host, score_metrics)]))
    metrics.update(reduce_metrics(update_metrics))
    metrics.update(attribution.derive(metrics))
    return metrics


def global_step(engine: Engine, state: step_fns.TrainState, data: TaskData, step: int,
                source: sources.Source = sources.Static(), log_samples: int = 0,
                timer: costs.PhaseTimer | None = None):
    """One global step: (state, metrics as floats, mini-batch composition, decoded samples (this
    process's first `log_samples` rows), attribution probe rows (rl/probe.py; [] on other steps),
    work for rl/costs.py's perf_row); `timer` times the phases. `source` gives the responses and
    π_old's parameters and is told before the updates change θ (rl/sources.py). The composition:
    its provenance ({"prompts": train-split indices} or {"responses": file indices}),
    "minibatches" (response r answers prompt r // G), "skipped" (1 per non-finite update). Under
    rl.overlong=penalty the advantages' rewards include DAPO's length penalty (overlong.py), the
    `reward` metric stays the task reward (`reward/overlong_penalty`: the mean penalty)."""
    rl = engine.cfg.rl
    timer = timer or costs.PhaseTimer(sync=rl.phase_sync)
    got = source.responses(engine, state, data, step, timer, log_samples)
    old, age_BxS = source.old_params(state.params), got.age_BxS
    with timer.phase("score"):
        rollout = engine.trim(got.rollout, rl.trim_bucket) if rl.trim_bucket else got.rollout
        batch, score_metrics = engine.score(old, rollout, got.rewards, age_BxS)
        timer.wait((batch, score_metrics))
    probed = None
    if probe.due(rl, step):  # rl.attribution_every: before the updates change θ
        with timer.phase("attribution"):
            probed = probe.Probe(engine, old, rollout, batch, step, age_BxS)
    with timer.phase("update"):
        source.before_update(state.params)
        minibatches = minibatches_of(engine, batch, step)
        trained = float(distributed.host(jnp.sum(batch.mask_BxT)))
    update_metrics = []
    for i, rows in enumerate(minibatches):
        if probed is not None:
            with timer.phase("attribution"):
                probed.before_update(state.params, rows)
        with timer.phase("update", key=f"update_{i}"):
            state, m = engine.update(state, engine.select(batch, rows))
            update_metrics.append(jax.tree.map(distributed.host, m))
    every = distributed.gather(got.host)  # the step's host rows of every process, once
    metrics = step_metrics(engine.cfg, every, got.metrics, score_metrics, update_metrics)
    composition = {**got.provenance, "minibatches": minibatches.tolist(),
                   "skipped": [int(step_fns.skipped(m)) for m in update_metrics]}
    dumped = []
    if probed is not None:
        with timer.phase("attribution"):
            dumped, layer_metrics = probed.finish(step + 1, data.tokenizer)
        metrics.update(layer_metrics)
    work = {"generated": float(np.sum(every.lengths)),
            "trained": trained, "rows": int(batch.tokens_BxS.shape[0]),
            "width": int(batch.tokens_BxS.shape[1]), "decode_steps": got.decode_steps}
    return state, metrics, composition, got.samples, dumped, work


def evaluate(engine: Engine, params, data: TaskData, step: int, log_samples: int = 0):
    """(metrics, samples): each eval set's avg@k, pass@k, mean length and truncated fraction and
    their means (rl/evals.py), sampled with inference numerics."""
    rl = engine.cfg.rl
    key = jax.random.fold_in(jax.random.key(rl.seed + 1), step)
    return evals.evaluate_sets(lambda t, m, k: engine.sample(params, t, m, k), data,
                               data.evals, key, rl.eval_problems, rl.eval_k,
                               evals.batch_multiple(engine.cfg), log_samples)


def log_samples(writer: MetricsWriter, log: JsonlLog, step: int, samples: list[dict]) -> None:
    """Append decoded samples to samples.jsonl and TensorBoard text (process 0's writer only)."""
    if not (writer.enabled and samples):
        return
    for row in samples:
        log.write({"step": int(step), **row})
    writer.text(step, "samples", samples)


def open_offline(cfg) -> OfflineRollouts | None:
    """The run's rl.offline_rollouts file (None without), checked whole before any training."""
    if not cfg.rl.offline_rollouts:
        return None
    offline = OfflineRollouts.load(cfg.rl.offline_rollouts)
    offline.check(group_size=cfg.rl.group_size,
                  responses_per_step=cfg.rl.prompts_per_step * cfg.rl.group_size,
                  steps=cfg.rl.steps, num_layers=cfg.model.num_layers,
                  top_k=cfg.model.top_k,
                  need_routes=cfg.rl.replay == "r3" or cfg.rl.attribution,
                  need_weights=cfg.rl.replay_weights)
    offline.check_values(vocab_size=cfg.model.vocab_size, num_experts=cfg.model.num_experts,
                         max_prompt_len=cfg.task.max_prompt_len,
                         max_new_tokens=cfg.sampling.max_new_tokens)
    return offline


def task_data(cfg, workdir: str) -> TaskData:
    """The task's data under `<workdir>/data`, built by process 0 while the others wait; a gs://
    workdir's in a local cache (`storage.local_dir`): array_record writes local files only."""
    path = storage.local_dir(os.path.join(workdir, "data"))
    create = functools.partial(TaskData.create, cfg.task, cfg.model.vocab_size, path,
                               cfg.rl.eval_sets, require_train=not cfg.rl.offline_rollouts)
    if distributed.is_main():
        data = create()
    distributed.barrier("task data")
    if not distributed.is_main():
        data = create()
    return data


def run(cfg, workdir: str, *, init_params=None, data: TaskData | None = None,
        progress: bool = True, allow_config_change=(), export_hf: str = "",
        export_dtype: str = "", trackers=("tensorboard",), replace_history: bool = False,
        profile: tuple[int, int] | None = None) -> dict:
    """Train (or resume) an RL run in `workdir`; returns the summary dict it also writes.

    A resume refuses a changed config (beyond preflight.RUN_CONTROL) unless `allow_config_change`
    names the fields ("section.field"). `export_hf`: also write the final policy there as a
    Hugging Face Qwen3-MoE checkpoint (special ids; tokenizer files with task.tokenizer_dir),
    tensors in `export_dtype` ('' = model.param_dtype; e.g. the start checkpoint's, over float32
    master weights). Another run's history with no checkpoint to resume is refused unless
    `replace_history` (preflight.check_history). `trackers`: sinks besides metrics.jsonl
    (trackers.NAMES; resumed via `<workdir>/trackers.json`). `profile`: (first, last) global
    steps (as metrics rows), traced per process into `<workdir>/profile/` (rl/profiling.py).
    Every process calls this and writes its checkpoint part; the first writes metrics, logs,
    plots, trackers, summary and holds the workdir's lock (runs/lock.py) against a second run."""
    preflight.check_workdir(workdir)
    preflight.check_urls(cfg, export_hf=export_hf)
    preflight.check_processes(cfg, export_hf)
    main = distributed.is_main()
    with lock.Lock(workdir, enabled=main):
        preflight.check_history(cfg, workdir, replace_history, export_hf)
        with Trackers(trackers, workdir, run_name=cfg.name, enabled=main) as tracker:
            with costs.PhaseTimer(sync=cfg.rl.phase_sync) as timer:
                return _run(cfg, workdir, init_params=init_params, data=data,
                            progress=progress, allow_config_change=allow_config_change,
                            export_hf=export_hf, export_dtype=export_dtype, tracker=tracker,
                            timer=timer, profile=profile, replace_history=replace_history)


def _run(cfg, workdir: str, *, init_params, data, progress, allow_config_change,
         export_hf, export_dtype, tracker: Trackers, timer: costs.PhaseTimer,
         profile, replace_history: bool) -> dict:
    main = distributed.is_main()
    data = data or task_data(cfg, workdir)
    preflight.check_data(cfg, data)
    engine = Engine.create(cfg, eos_id=data.tokenizer.eos_id, pad_id=data.tokenizer.pad_id,
                           stop_ids=data.tokenizer.stop_ids)
    offline = open_offline(cfg)
    # Before the Checkpointer: a log that is a symbolic link is refused with nothing open.
    logs = [JsonlLog(os.path.join(workdir, f"{name}.jsonl"), enabled=main)
            for name in ("minibatches", "samples", "attribution")]
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=cfg.rl.keep_checkpoints,
                        async_=cfg.rl.async_checkpoints)
    if init_params is None:
        init_params = tf.init_params(jax.random.key(cfg.rl.seed), cfg.model)
    state = engine.init_state(init_params)
    source = sources.for_run(cfg, offline, data.tokenizer.pad_id, state.params)
    saved = lambda: {**state._asdict(), **source.state_dict()}
    start = 0
    had_checkpoints = bool(ckpt.all_steps())
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    logged = [r["step"] for r in read_metrics(metrics_path)]
    try:  # a refused resume closes the Checkpointer
        resume.choose(workdir, ckpt.all_steps(), logged)
        restored = ckpt.restore_latest(saved(), check_meta=lambda meta: (
            preflight.check_resumed_config(meta.get("config"), cfg, allow_config_change,
                                           workdir)), usable=resume.unusable(logged))
        if had_checkpoints and restored is None:  # decided by restoring: keep or move aside
            workdir_history.after_restore(cfg, workdir, replace_history, export_hf)
    except Exception:
        ckpt.close()
        raise
    writer = MetricsWriter(workdir, enabled=main, tensorboard=tracker.tensorboard)
    tracker.log_config(flat_dict(cfg))
    if restored is not None:
        # Checkpoints are numbered by completed global steps, like metrics rows.
        latest, state_dict, _ = restored
        source.load_state_dict(state_dict)  # takes its own keys out
        # A rate changed on resume (allow_config_change) takes effect here.
        state = engine.with_learning_rate(step_fns.TrainState(**state_dict))
        start = latest
        if main:
            resume.report_torn(metrics_path)
        writer.truncate_after(latest)
        for log in logs:
            log.truncate_after(latest)
        if main:
            resume.check_metrics_rows(metrics_path, latest)
    else:
        writer.truncate_after(-1)  # rows of a run killed before its first checkpoint
        for log in logs:
            log.truncate_after(-1)
        _log_row(0, *_first_evaluation(engine, state.params, data, timer), {}, (), writer,
                 logs, tracker)
    estimates, said = costs.estimate_phases(engine)
    if said and main and progress:
        print(said, flush=True)
    acc = last_accuracy(read_metrics(metrics_path) if restored is not None and main else [])
    profiler = profiling.Profiler(workdir, profile)
    if main and (note := profiling.window_note(profile, start, cfg.rl.steps)):
        logging.warning(note)
    bar = tqdm(range(start, cfg.rl.steps), initial=start, total=cfg.rl.steps,
               disable=not (progress and main), desc=cfg.name)
    skips = 0
    short = dynamic.ShortBatches(cfg.rl.max_consecutive_skips)
    meta = {"config": flat_dict(cfg)}
    timer.row()  # the first row's times start with the loop
    try:
        for step in bar:
            profiler.before(step + 1)
            ckpt.check_saves()  # a failed background save stops the run here
            lock.check_held()  # so does a lock another run took over
            every = cfg.rl.log_samples_every
            train_samples = cfg.rl.log_samples if every and (step + 1) % every == 0 else 0
            state, metrics, composition, samples, dumped, work = global_step(
                engine, state, data, step, source, train_samples, timer)
            if (step + 1) % cfg.rl.eval_every == 0 or step + 1 == cfg.rl.steps:
                with timer.phase("eval"):
                    eval_metrics, eval_samples = evaluate(engine, state.params, data,
                                                          step + 1, cfg.rl.log_samples)
                metrics.update(eval_metrics)
                samples += eval_samples
            times = timer.row()
            if main:  # every process waits at the same points; process 0 logs
                metrics.update(times)
                metrics.update(costs.derived_times(times, metrics, work))
                metrics.update(costs.perf_row(cfg, times, estimates=estimates, **work))
            with timer.phase("logs"):
                _log_row(step + 1, metrics, samples, composition, dumped, writer, logs,
                         tracker)
            skips = step_fns.count_skips(skips, composition["skipped"],
                                      cfg.rl.max_consecutive_skips, "rl")
            short.check(step + 1, metrics)
            acc = metrics.get("eval/accuracy", acc)
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc="-" if acc is None else
                            f"{acc:.3f}", kl=f"{metrics['kl/train_infer_k1']:.1e}")
            if (step + 1) % cfg.rl.checkpoint_every == 0 or step + 1 == cfg.rl.steps:
                with timer.phase("logs"):
                    for log in (writer, *logs):  # they cover the step
                        log.flush()
                with timer.phase("checkpoint"):
                    ckpt.save(step + 1, saved(), {"step": step + 1, **meta})
            profiler.after(step + 1)
    except KeyboardInterrupt:  # Ctrl-C: stop bounds the wait for the save in flight
        ckpt.stop()
        raise
    finally:  # an error still finishes the saves already started
        profiler.close()
        try:
            ckpt.wait()  # raises CheckpointSaveError if the last save failed
        finally:
            ckpt.close()
            writer.close()
            for log in logs:
                log.flush()
    if export_hf:
        export(cfg, state.params, data.tokenizer, export_hf, export_dtype)
    return _finish(cfg, workdir, int(distributed.host(state.skipped)), tracker, progress)


def _first_evaluation(engine: Engine, params, data: TaskData, timer: costs.PhaseTimer):
    """(metrics, samples) of the row before training: the held-out evaluation at θ_0, timed."""
    timer.row()  # the row's times start here
    with timer.phase("eval"):
        metrics, samples = evaluate(engine, params, data, 0, engine.cfg.rl.log_samples)
    metrics.update(timer.row())
    return metrics, samples


def _log_row(step: int, metrics: dict, samples: list, composition: dict, dumped,
             writer: MetricsWriter, logs, tracker: Trackers) -> None:
    """Write a step's row (step 0: before training): metrics, samples, mini-batch composition and
    attribution rows (`logs`: minibatches, samples, attribution JSONL), and to the trackers."""
    minibatch_log, samples_log, attribution_log = logs
    if composition:
        minibatch_log.write({"step": step, **composition})
    for row in dumped:
        attribution_log.write(row)
    tracker.log(step, writer.write(step, metrics))
    log_samples(writer, samples_log, step, samples)
    tracker.log_samples(step, samples)


def export(cfg, params, tok, path: str, dtype: str = "") -> None:
    """The policy as a Hugging Face Qwen3-MoE checkpoint at `path`, tensors in `dtype` ('' =
    model.param_dtype), with the tokenizer's ids and files."""
    dtype = dtype or cfg.model.param_dtype
    save_qwen3_moe(jax.tree.map(lambda x: x.astype(dtype_of(dtype)), params),
                   cfg.model.replace(param_dtype=dtype), path,
                   config_extra={"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
                                 "bos_token_id": tok.bos_id},
                   tokenizer_dir=cfg.task.tokenizer_dir, stop_ids=tok.stop_ids)


def _finish(cfg, workdir: str, skipped: int, tracker: Trackers, progress: bool) -> dict:
    """Every process meets; process 0 writes the plots and summary.json and returns it."""
    distributed.barrier("run end")
    if not distributed.is_main():
        return {"steps": cfg.rl.steps, "skipped_updates": skipped}
    records = read_metrics(workdir)
    tracker.log_plots(cfg.rl.steps, plot_metrics(records, os.path.join(workdir, "plots")))
    summary = run_summary(records, skipped)
    storage.write_text(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=2))
    if progress:
        print(costs.cost_table(summary), flush=True)
    return summary


def last_accuracy(records: list[dict]) -> float | None:
    """The last held-out accuracy of a run's rows (the progress bar's until the next)."""
    evaluated = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    return evaluated[-1] if evaluated else None


def accuracy_gain(first: dict, last: dict) -> dict | None:
    """End − start held-out accuracy of two evaluation rows and its 95 % interval
    ±1.96·sqrt(se_start² + se_end²), their standard errors over problems (evals.py) taken as
    independent (conservative: they share problems); None without both."""
    se = [r.get("eval/accuracy_stderr") for r in (first, last)]
    if first is last or None in se:
        return None
    gain = last["eval/accuracy"] - first["eval/accuracy"]
    half = 1.96 * float(np.hypot(*se))
    return {"gain": gain, "interval_95": [gain - half, gain + half]}


def run_summary(records: list[dict], skipped: int) -> dict:
    """The run's summary.json: start / end held-out accuracy (`eval/accuracy`, the mean over eval
    sets), the gain with its interval (`accuracy_gain`), each set's end avg@k, start / end reward
    (means of the first / last fifth of the steps), steps and skipped updates."""
    evaluated = [r for r in records if r.get("eval/accuracy") is not None]
    last = evaluated[-1] if evaluated else {}
    sets = {k[len("eval/"):-len("/avg@k")]: v for k, v in last.items()
            if k.startswith("eval/") and k.endswith("/avg@k")}
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    w = max(1, len(rewards) // 5)
    cost = {"seconds_per_step": costs.time_split(records),
            "measured_vs_estimated": [
                {"phase": p, "measured_s": m, "estimated_s": e, "ratio": q}
                for p, m, e, q in costs.measured_vs_estimated(records)]}
    return {
        "start_accuracy": evaluated[0]["eval/accuracy"] if evaluated else None,
        "end_accuracy": last.get("eval/accuracy"),
        "accuracy_gain": accuracy_gain(evaluated[0], last) if evaluated else None,
        "end_accuracy_by_set": sets,
        "start_reward": float(np.mean(rewards[:w])) if rewards else None,
        "end_reward": float(np.mean(rewards[-w:])) if rewards else None,
        "steps": records[-1]["step"] if records else 0,
        "skipped_updates": skipped,
        # rl.dynamic_sampling: steps that trained on a short batch, and on an empty one.
        **({"short_batches": sum(r["dynamic/filled_frac"] < 1 for r in filled),
            "empty_batches": sum(r["dynamic/filled_frac"] == 0 for r in filled)}
           if (filled := [r for r in records if r.get("dynamic/filled_frac") is not None])
           else {}),
        "cost": cost,
    }
