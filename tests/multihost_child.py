"""One process of a multi-process run, for tests/multihost_test.py (not a test module).

    python tests/multihost_child.py WORKDIR STEPS PROCESS_ID NUM_PROCESSES PORT [STALENESS]

Runs the tiny RL config (float64, mesh data=2 × fsdp=2 × expert=2 over 8 CPU devices in
all, expert parallel, the sampler in its serving layout) for STEPS global steps in WORKDIR, as process PROCESS_ID of NUM_PROCESSES (one
process: no jax.distributed). The environment sets the CPU device count per process.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def config(steps: int, staleness: int = 0):
    from rl_helpers import tiny_cfg
    cfg = tiny_cfg(mesh=(2, 2, 2), steps=steps, num_minibatches=1, eval_every=1,
                   eval_problems=8, eval_k=1, checkpoint_every=1, max_staleness=staleness)
    # The sampler in the serving layout with expert parallelism: its weights resharded
    # across processes once per call, one expert per device. Partial rollouts (S >= 1):
    # 8 slots for 8 responses a step, 16 in flight.
    return cfg.replace(model=cfg.model.replace(param_dtype="float64", compute_dtype="float64",
                                               expert_parallel=True),
                       sampling=cfg.sampling.replace(layout="serve",
                                                     max_batch=8 if staleness else 0))


def main(argv):
    workdir, steps, pid, n, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    from stablerl_jax import distributed
    if n > 1:
        distributed.initialize(f"localhost:{port}", n, pid, heartbeat_timeout_seconds=10,
                               initialization_timeout=120)
    import jax
    cache = os.environ.get("STABLERL_TEST_JAX_CACHE")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from stablerl_jax.rl import loop
    staleness = int(argv[5]) if len(argv) > 5 else 0
    summary = loop.run(config(steps, staleness), workdir, progress=False)
    print("done", pid, summary, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
