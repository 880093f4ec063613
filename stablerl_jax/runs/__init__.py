"""A run's state and how it survives: files, locks, checkpoints, logs.

    storage.py            a local directory or a `gs://` bucket behind one interface
    storage_gcs.py        Cloud Storage's naming rules (`check_url`), its client (the run lock)
    lock.py               one run per workdir: the lock file and its take-over rules
    checkpoint.py         orbax checkpoints: atomic, async, keep-N, resume from complete steps
    checkpoint_steps.py   which checkpoint entries are steps; cut-short saves and their clean-up
    checkpoint_guards.py  what an open checkpointer installs around orbax (errors, signals)
    metrics_io.py         metrics.jsonl (the source of truth), TensorBoard events, plots
    trackers.py           Weights & Biases and MLflow beside metrics.jsonl
    compile_cache.py      JAX's persistent compilation cache
"""
