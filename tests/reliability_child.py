"""A training process the reliability tests start, kill and resume (not a test module).

    python tests/reliability_child.py WORKDIR DATADIR [--die-in-save STEP]
        [--fsize-limit-at STEP] [--wait-in-save STEP FILE] [--say-saves] [--staleness S]
        [--traceback]

Runs the tiny RL config of rl_helpers for STEPS global steps in WORKDIR (task data cached
in DATADIR), behind the entry points' one-line errors (exit 2; 130 for Ctrl-C). With
--die-in-save STEP the process SIGKILLs itself right after the checkpoint save of STEP has
started (its files half written), the way a preempted job dies mid-write. With
--fsize-limit-at STEP the process may write no file larger than FSIZE_LIMIT bytes from the
save of STEP on (RLIMIT_FSIZE, as `ulimit -f` sets it): the checkpoint's data file no
longer fits, the metrics rows still do, the way a disk fills up during a save. With
--wait-in-save STEP FILE it waits, once the save of STEP has started, until FILE exists (a
run still training while another one starts). With --say-saves it prints `SAVE <step>` on
stdout as each checkpoint save starts, the previous one complete (where the interrupt
tests aim their SIGINT). --staleness S runs partial rollouts (config). SIGUSR1 prints
every thread's stack on stderr (what a test sends a child that does not exit in time).
"""
import faulthandler
import os
import resource
import signal
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_helpers import tiny_cfg  # noqa: E402

from experiments.cli_errors import one_line_errors  # noqa: E402
from stablerl_jax.data.task import TaskData  # noqa: E402
from stablerl_jax.rl import loop  # noqa: E402
from stablerl_jax.runs import checkpoint  # noqa: E402

STEPS = 4
FSIZE_LIMIT = 64 * 1024


def config(staleness: int = 0):
    """The run; `staleness` S >= 1: partial rollouts (4 sampler slots for 8 responses, so
    responses carry over between steps; the queue is part of every checkpoint)."""
    cfg = tiny_cfg(steps=STEPS, checkpoint_every=1, eval_every=2, num_minibatches=2,
                   max_staleness=staleness)
    if staleness:
        cfg = cfg.replace(sampling=cfg.sampling.replace(max_batch=4))
    return cfg


def _hook_save(step_at: int, before=None, after=None) -> None:
    """Call `before(checkpointer)` / `after(checkpointer)` around the start of the
    checkpoint save of `step_at`."""
    save = checkpoint.Checkpointer.save

    def hooked(self, step, state, meta, **kw):
        if step == step_at and before:
            before(self)
        started = save(self, step, state, meta, **kw)
        if step == step_at and after:
            after(self)
        return started

    checkpoint.Checkpointer.save = hooked


def _say_saves() -> None:
    save = checkpoint.Checkpointer.save

    def said(self, step, state, meta, **kw):
        self.wait()  # the save would wait for the previous one first anyway
        print(f"SAVE {step}", flush=True)
        return save(self, step, state, meta, **kw)

    checkpoint.Checkpointer.save = said


@one_line_errors
def main(argv):
    workdir, data_dir = argv[0], argv[1]
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C as in a foreground shell: a process started in the background (`cmd &` in a
    # script) inherits SIGINT ignored, and Python then keeps ignoring it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "--say-saves" in argv:
        _say_saves()
    if "--die-in-save" in argv:
        _hook_save(int(argv[argv.index("--die-in-save") + 1]),
                   after=lambda _: os.kill(os.getpid(), signal.SIGKILL))
    if "--fsize-limit-at" in argv:
        def limit(ckpt):
            ckpt.wait()  # the earlier saves complete: only this one meets the limit
            resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.RLIM_INFINITY))
        _hook_save(int(argv[argv.index("--fsize-limit-at") + 1]), before=limit)
    if "--wait-in-save" in argv:
        i = argv.index("--wait-in-save")
        flag = argv[i + 2]

        def wait_for_flag(_):
            deadline = time.time() + 600
            while not os.path.exists(flag) and time.time() < deadline:
                time.sleep(0.05)
        _hook_save(int(argv[i + 1]), after=wait_for_flag)
    cache = os.environ.get("STABLERL_TEST_JAX_CACHE")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        # Shared with the test processes: a bound turns on jax's file lock (conftest.py).
        jax.config.update("jax_compilation_cache_max_size", 16 << 30)
    cfg = config(int(argv[argv.index("--staleness") + 1]) if "--staleness" in argv else 0)
    data = TaskData.create(cfg.task, cfg.model.vocab_size, data_dir)
    loop.run(cfg, workdir, data=data, progress=False)


if __name__ == "__main__":
    main(sys.argv[1:])
