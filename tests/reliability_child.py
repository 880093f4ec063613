"""A training process the reliability tests start, kill and resume (not a test module).

    python tests/reliability_child.py WORKDIR DATADIR [--die-in-save STEP]

Runs the tiny RL config of rl_helpers for STEPS global steps in WORKDIR (task data cached
in DATADIR). With --die-in-save STEP the process SIGKILLs itself right after the
checkpoint save of STEP has started (its files half written), the way a preempted job
dies mid-write.
"""
import os
import signal
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_helpers import tiny_cfg  # noqa: E402

from stablerl_jax import checkpoint  # noqa: E402
from stablerl_jax.data.task import TaskData  # noqa: E402
from stablerl_jax.rl import loop  # noqa: E402

STEPS = 4


def config():
    return tiny_cfg(steps=STEPS, checkpoint_every=1, eval_every=2, num_minibatches=2)


def main(argv):
    workdir, data_dir = argv[0], argv[1]
    if "--die-in-save" in argv:
        die_at = int(argv[argv.index("--die-in-save") + 1])
        save = checkpoint.Checkpointer.save

        def save_then_die(self, step, state, meta, **kw):
            started = save(self, step, state, meta, **kw)
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return started

        checkpoint.Checkpointer.save = save_then_die
    cache = os.environ.get("STABLERL_TEST_JAX_CACHE")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    cfg = config()
    data = TaskData.create(cfg.task, cfg.model.vocab_size, data_dir)
    loop.run(cfg, workdir, data=data, progress=False)


if __name__ == "__main__":
    main(sys.argv[1:])
