"""Orbax checkpoints: bitwise round trip, shardings, keep-N, async, complete steps only,
entries the checkpoints did not write, errors, failed saves' logs, interrupts."""
import asyncio
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import sys
import weakref
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import cpu_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from stablerl_jax.runs import checkpoint_guards
from stablerl_jax.runs.checkpoint import (
    LOG_FILE,
    Checkpointer,
    CheckpointSaveError,
    checksums,
    load_params,
    save_params,
)

# clip + adamw: a NamedTuple chain that includes an EmptyState, as the trainer's optimizer does.
_OPT = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def _state(seed=0, d=3):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"w": jax.random.normal(k1, (8, d)), "b": {"c": jnp.arange(d, dtype=jnp.float32) + seed}}
    clip_state, (adam, *rest) = _OPT.init(params)
    # Non-trivial moments, as after some updates (optax's own update is slow to run eagerly).
    adam = adam._replace(count=jnp.array(3, jnp.int32), mu=jax.tree.map(jnp.sin, params),
                         nu=jax.tree.map(jnp.square, params))
    return {"params": params, "opt_state": (clip_state, (adam, *rest)),
            "step": jnp.array(7 + seed, jnp.int32), "rng": jax.random.key_data(k2)}


def _assert_bitwise(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                                      np.asarray(y).reshape(-1).view(np.uint8))


def test_round_trip_bitwise_with_optax_state(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=3, async_=True)
    state = _state()
    meta = {"config": {"lr": 1e-3, "name": "x"}, "data_position": 12, "metrics_rows": 4}
    assert ck.save(3, state, meta)
    ck.wait()
    restored, got_meta = ck.restore(None, _state(seed=1))  # target values are irrelevant
    _assert_bitwise(restored, state)
    assert got_meta == meta
    assert isinstance(restored["opt_state"][1][0], optax.ScaleByAdamState)
    # A fresh Checkpointer over the same directory (a resumed process) sees the same.
    ck.close()
    restored2, _ = Checkpointer(str(tmp_path / "ck")).restore(3, jax.eval_shape(_state))
    _assert_bitwise(restored2, state)


def test_restore_lands_on_target_shardings(tmp_path):
    mesh = Mesh(np.array(cpu_devices()).reshape(4, 2), ("data", "fsdp"))
    state = _state(d=4)
    saved = jax.device_put(state, NamedSharding(mesh, P()))
    saved["params"]["w"] = jax.device_put(state["params"]["w"], NamedSharding(mesh, P("data")))
    ck = Checkpointer(str(tmp_path / "ck"), async_=False)
    ck.save(1, saved, {})
    target = jax.device_put(_state(seed=2, d=4), NamedSharding(mesh, P()))
    target["params"]["w"] = jax.device_put(target["params"]["w"],
                                           NamedSharding(mesh, P(None, "fsdp")))
    restored, _ = ck.restore(1, target)
    _assert_bitwise(restored, state)
    assert restored["params"]["w"].sharding == target["params"]["w"].sharding
    assert restored["step"].sharding == target["step"].sharding


def test_keep_n_and_latest(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=2, async_=True)
    assert ck.latest_step() is None
    for s in range(1, 5):
        assert ck.save(s, _state(s), {"step": s})
    ck.wait()
    assert ck.all_steps() == [3, 4] and ck.latest_step() == 4
    assert sorted(os.listdir(tmp_path / "ck")) == ["3", "4"]
    assert not ck.save(4, _state(), {})  # not above the latest: skipped, and says so
    _, meta = ck.restore(None, _state())
    assert meta == {"step": 4}


def test_saved_step_is_committed_the_way_resume_expects(tmp_path):
    """The completeness rule relies on orbax writing commit_success.txt; pin that here."""
    ck = Checkpointer(str(tmp_path / "ck"), async_=False)
    ck.save(5, _state(), {})
    assert (tmp_path / "ck" / "5" / "commit_success.txt").exists()


def test_partial_checkpoints_are_never_resumed(tmp_path):
    d = tmp_path / "ck"
    ck = Checkpointer(str(d), keep=5, async_=False)
    ck.save(2, _state(), {"step": 2})
    ck.close()
    # A save killed midway leaves orbax's temporary directory, with some items in it.
    tmp = d / "9.orbax-checkpoint-tmp"
    (tmp / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    (tmp / "_CHECKPOINT_METADATA").write_text("{}")
    (d / "11.orbax-checkpoint-tmp-1712345678").mkdir()  # an earlier orbax's name
    # A save killed after orbax wrote its commit file into the temporary directory, before
    # the rename: whole, but never committed.
    shutil.copytree(d / "2", d / "4.orbax-checkpoint-tmp")
    meta = json.loads((d / "2" / "meta" / "metadata").read_text())
    (d / "4.orbax-checkpoint-tmp" / "meta" / "metadata").write_text(
        json.dumps(dict(meta, checkpoint_step=4)))
    # A step-named directory without the commit file (half-copied / non-atomic filesystem),
    # holding orbax's step metadata and the step record of these checkpoints.
    (d / "7" / "state").mkdir(parents=True)
    shutil.copy(d / "2" / "_CHECKPOINT_METADATA", d / "7")
    shutil.copytree(d / "2" / "meta", d / "7" / "meta")
    # Unknown names must not crash anything.
    for name in ("not_a_step", "3.backup", "-1", "step_x"):
        (d / name).mkdir()
    (d / "notes.txt").write_text("x")

    ck2 = Checkpointer(str(d), keep=5, async_=False)
    assert ck2.all_steps() == [2] and ck2.latest_step() == 2
    _, meta = ck2.restore(None, _state())
    assert meta == {"step": 2}
    assert not tmp.exists()  # leftovers of killed saves are cleaned up
    assert not (d / "11.orbax-checkpoint-tmp-1712345678").exists()
    assert not (d / "4.orbax-checkpoint-tmp").exists()
    assert (d / "7.incomplete" / "state").is_dir()  # set aside, not deleted
    with pytest.raises(ValueError, match=r"no complete checkpoint for step 7.*\[2\]"):
        ck2.restore(7, _state())
    # Later saves are not blocked by the incomplete step 7.
    assert ck2.save(3, _state(), {"step": 3})
    assert ck2.latest_step() == 3


def test_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        Checkpointer(str(f))
    with pytest.raises(ValueError, match="no complete checkpoint in .*empty"):
        Checkpointer(str(tmp_path / "empty")).restore(None, _state())
    ck = Checkpointer(str(tmp_path / "ck"), async_=False)
    with pytest.raises(ValueError, match="JSON-serializable"):
        ck.save(0, _state(), {"x": object()})
    with pytest.raises(ValueError, match="key_data"):
        ck.save(0, {"rng": jax.random.key(0)}, {})
    ck.save(0, _state(), {})
    bigger = _state(d=5)  # a different model config: every param and moment changes shape
    with pytest.raises(ValueError, match=r"does not match.*params/w: checkpoint float32\[8, 3\] "
                                         r"vs target float32\[8, 5\]"):
        ck.restore(0, bigger)
    with pytest.raises(ValueError, match="rng: in checkpoint, not in target"):
        ck.restore(0, {k: v for k, v in _state().items() if k != "rng"})
    bf16 = {**_state(), "params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), _state()["params"])}
    with pytest.raises(ValueError, match="params/b/c: checkpoint float32\\[3\\] vs target bfloat16"):
        ck.restore(0, bf16)  # orbax alone would cast silently


def test_params_round_trip(tmp_path):
    params = _state()["params"]
    path = str(tmp_path / "sft")
    save_params(path, params)
    _assert_bitwise(load_params(path, params), params)
    _assert_bitwise(load_params(path, jax.eval_shape(lambda: params)), params)
    _assert_bitwise(load_params(path), params)
    with pytest.raises(ValueError, match="already exists"):
        save_params(path, params)
    with pytest.raises(ValueError, match="no complete params checkpoint"):
        load_params(str(tmp_path / "missing"), params)
    with pytest.raises(ValueError, match="params/w|w: checkpoint"):
        load_params(path, _state(d=5)["params"])


def _tree(path):
    """{relative path: sha256 of a file, or 'dir'} of everything under `path`."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), path)] = "dir"
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), path)] = hashlib.sha256(
                    f.read()).hexdigest()
    return out


def test_entries_the_checkpoints_did_not_write_are_left_untouched(tmp_path, caplog):
    """Step-named directories without this module's metadata (another program's, on a
    shared disk) are never listed, resumed from, set aside, deleted by keep-N or
    overwritten; they are named in one warning, and a save of their step fails instead."""
    d = tmp_path / "ck"
    for name in ("1", "2", "3", "7"):
        (d / name / "sub").mkdir(parents=True)
        (d / name / "sub" / "data.bin").write_bytes(os.urandom(64))
    (d / "3" / "commit_success.txt").write_text("theirs")  # committed, but not ours
    # Another program's orbax checkpoint with items named as ours, committed: orbax's step
    # metadata alone proves nothing. And a meta with a step record alone.
    (d / "8" / "state").mkdir(parents=True)
    (d / "8" / "_CHECKPOINT_METADATA").write_text(
        '{"item_handlers": {"state": "theirs", "meta": "theirs"}}')
    (d / "8" / "commit_success.txt").write_text("theirs")
    (d / "9" / "meta").mkdir(parents=True)
    (d / "9" / "meta" / "metadata").write_text('{"checkpoint_step": 9}')
    (d / "9" / "commit_success.txt").write_text("theirs")
    # Another program's saves in flight (or cut short): orbax's own clean-up would delete
    # both; the second is where orbax would write step 10.
    for name, item in (("5.orbax-checkpoint-tmp-1712345678", "default"),
                       ("10.orbax-checkpoint-tmp", "params")):
        (d / name / item).mkdir(parents=True)
        (d / name / "_CHECKPOINT_METADATA").write_text('{"item_handlers": null}')
        (d / name / item / "data.bin").write_bytes(os.urandom(64))
    (d / "notes.txt").write_text("x")
    before = _tree(d)
    with caplog.at_level("WARNING"):
        ck = Checkpointer(str(d), keep=1, async_=False)
    warnings = [r.getMessage() for r in caplog.records if "did not write" in r.getMessage()]
    assert len(warnings) == 1 and (
        "left untouched: 1, 2, 3, 5.orbax-checkpoint-tmp-1712345678, 7, 8, 9, "
        "10.orbax-checkpoint-tmp, notes.txt (") in warnings[0]
    assert ck.all_steps() == [] and ck.latest_step() is None
    with pytest.raises(CheckpointSaveError, match=f"{d / '1'} exists and was not written by "
                                                  "these checkpoints.*move it out"):
        ck.save(1, _state(), {"step": 1})
    ck.close()
    ck = Checkpointer(str(d), keep=1, async_=False)
    with pytest.raises(CheckpointSaveError, match=f"{d / '10.orbax-checkpoint-tmp'} exists "
                                                  "and was not written"):
        ck.save(10, _state(), {"step": 10})
    ck.close()
    ck = Checkpointer(str(d), keep=1, async_=False)
    for step in (4, 5, 6):  # keep=1 deletes 4 and 5, and nothing of the others
        assert ck.save(step, _state(step), {"step": step})
    assert ck.all_steps() == [6]
    restored, meta = ck.restore(None, _state())
    _assert_bitwise(restored, _state(6))
    ck.close()
    assert {k: v for k, v in _tree(d).items() if not k.startswith("6")} == before


def test_a_failed_save_logs_orbax_tracebacks_to_a_file(tmp_path, caplog):
    """A background save that fails (here a 64 KiB file-size limit) reports one error that
    names the log; orbax's own error records, tracebacks and all, went to that file."""
    ck = Checkpointer(str(tmp_path / "ck"), async_=True)
    state = {"w": jnp.arange(64 * 1024, dtype=jnp.float32)}  # a 256 KiB data file
    checksums(state)  # compiled (and cached) before the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with caplog.at_level("INFO"):
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        try:
            ck.save(1, state, {"step": 1})
            with pytest.raises(CheckpointSaveError) as e:
                ck.wait()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        ck.close()
    log = tmp_path / LOG_FILE
    assert "could not be saved" in str(e.value) and f"(orbax's log of the failure: {log})" \
        in str(e.value)
    text = log.read_text()
    assert "Traceback" in text and "File too large" in text
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # none on the terminal
    assert not (tmp_path / "ck" / "1").exists()
    # TensorStore's writes of the failed save may complete after orbax closed the save's
    # event loop, even after the Checkpointer closed: Python prints each callback's
    # "Event loop is closed" as an unraisable exception, a traceback on the terminal.
    # Those go to the same log.
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError, match="Event loop is closed") as late:
        loop.call_soon_threadsafe(print)
    sys.unraisablehook(SimpleNamespace(exc_type=RuntimeError, exc_value=late.value,
                                       exc_traceback=late.value.__traceback__,
                                       err_msg=None, object=None))
    assert "a checkpoint save's callback ran after the save's event loop closed" in \
        log.read_text() and "call_soon_threadsafe" in log.read_text()
    # So does asyncio's report of the failed save's tasks, when they are collected.
    never = ("Task exception was never retrieved\nfuture: <Task finished coro=<write_fragment()"
             " defined at /site-packages/orbax/checkpoint/serialization.py:126> exception="
             f"ValueError('Error writing {tmp_path / 'ck' / '1.orbax-checkpoint-tmp'}: File "
             "too large')>")
    with caplog.at_level("INFO"):
        logging.getLogger("asyncio").error(never)
    assert never in log.read_text() and never not in caplog.text


@pytest.fixture
def python_sigint(monkeypatch):
    """Python's own SIGINT handler for the test, the one a Checkpointer replaces, and a
    fresh interrupt state. A process started in the background (`cmd &` in a script, as CI
    may run the suite) inherits SIGINT ignored, and a Checkpointer leaves an ignored SIGINT
    so; a Checkpointer another test left open would keep the shared state's handler. The
    previous handler and unraisable hook are restored afterwards, and the guards' hook
    starts without the handlers earlier tests' logs left on it."""
    monkeypatch.setattr(checkpoint_guards, "INTERRUPTS", checkpoint_guards.Interrupts())
    monkeypatch.setattr(checkpoint_guards, "UNRAISABLE", checkpoint_guards.UnraisableHook())
    hook = sys.unraisablehook
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        sys.unraisablehook = hook


@pytest.mark.usefixtures("python_sigint")
def test_an_interrupt_inside_a_save_is_raised_once_the_save_has_started(tmp_path):
    """Ctrl-C inside orbax's save is held until the save has started (else its writer
    threads wait 300 s for a directory that never comes); `stop` then lets it finish."""
    d = str(tmp_path / "ck")
    before = signal.getsignal(signal.SIGINT)
    ck = Checkpointer(d, keep=3, async_=True)
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    save = ck.manager.save

    def interrupted(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the save
        return save(*args, **kwargs)

    ck.manager.save = interrupted
    with pytest.raises(KeyboardInterrupt):
        ck.save(1, _state(1), {"step": 1})
    ck.stop()
    assert signal.getsignal(signal.SIGINT) == before  # handed back
    ck = Checkpointer(d)
    assert ck.all_steps() == [1]
    _assert_bitwise(ck.restore(1, _state())[0], _state(1))
    ck.close()


@pytest.mark.usefixtures("python_sigint")
def test_an_interrupt_python_drops_is_raised_at_the_next_check(tmp_path):
    """A KeyboardInterrupt raised inside a weakref callback is printed and dropped by
    Python; the Checkpointer raises it at its next check, and only once."""
    ck = Checkpointer(str(tmp_path / "ck"), async_=True)

    class Owner:
        pass

    owner = Owner()
    ref = weakref.ref(owner, lambda _: signal.raise_signal(signal.SIGINT))
    del owner  # the callback runs, the handler raises inside it, Python drops that
    assert ref() is None
    with pytest.raises(KeyboardInterrupt):
        ck.check_saves()
    ck.check_saves()
    ck.close()


def test_other_unraisable_errors_reach_the_hook_the_guards_replaced(python_sigint,
                                                                     monkeypatch):
    """While the guards hold `sys.unraisablehook`, an unraisable error that is neither an
    interrupt they raise again nor a failed save's late callback goes to the hook that was
    in place before them, once."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    other = SimpleNamespace(exc_type=ValueError, exc_value=ValueError("in a __del__"),
                            exc_traceback=None, err_msg=None, object=None)
    interrupts = checkpoint_guards.INTERRUPTS  # python_sigint's fresh one
    interrupts.open()
    try:
        assert sys.unraisablehook == checkpoint_guards.UNRAISABLE.hook
        sys.unraisablehook(other)
    finally:
        interrupts.close()
    assert seen == [other] and sys.unraisablehook == seen.append
    errors = checkpoint_guards.OrbaxErrors()  # no log open: nothing to write it to
    assert not errors._unraisable(other)


def test_guards_opening_again_after_each_other_hand_an_error_on_once(python_sigint,
                                                                    monkeypatch, tmp_path):
    """The interrupt guard opens, an orbax error log opens over it, the interrupt guard
    closes and opens again (a second run in one process): an unraisable error still reaches
    the hook in place before them once, not a loop between the guards' hooks, and the
    hook is handed back when both have closed."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(checkpoint_guards, "ORBAX_ERRORS", checkpoint_guards.OrbaxErrors())
    other = SimpleNamespace(exc_type=ValueError, exc_value=ValueError("in a __del__"),
                            exc_traceback=None, err_msg=None, object=None)
    interrupts = checkpoint_guards.INTERRUPTS
    interrupts.open()
    log = checkpoint_guards.ErrorLog(str(tmp_path / "orbax.log"), str(tmp_path))
    interrupts.close()
    interrupts.open()
    sys.unraisablehook(other)
    interrupts.close()
    log.close()
    assert seen == [other] and sys.unraisablehook == seen.append
