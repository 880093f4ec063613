"""The training engine and the global-step loop that drives sampler and trainer.

    loop.py        `run`: the global-step loop with eval, checkpoints and logs
    sources.py     where a step's `Responses` come from: static, dynamic, partial, offline
    engine.py      the jitted, mesh-sharded steps of one experiment, built once
    step_fns.py    score (π_old), update (π_θ) and SFT update as pure functions
    accumulate.py  micro-batching: a mini-batch's loss and gradient as a sum over slices
    dynamic.py     dynamic sampling (DAPO): refill groups with zero advantage
    inflight.py    partial rollouts under a staleness bound
    probe.py       the attribution probe, every few steps
    evals.py       held-out evaluation and the decoded samples a run logs
    costs.py       wall time per phase, throughput, model FLOP/s and MFU
    profiling.py   `--profile FIRST:LAST`: a jax.profiler trace of chosen steps
    preflight.py   checks before any work: workdir, devices, processes, layout
    history.py     a workdir's history: kept unless resumed, or moved aside on request
    resume.py      which checkpoint a run may resume from, and the log's repair
    sft.py         the supervised cold start
"""
