"""Orbax checkpoints: bitwise round trip, keep-N, partial checkpoints never resumed."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stablerl_jax.checkpoint import Checkpointer, load_params, save_params


def _state(seed=0):
    params = {"w": jax.random.normal(jax.random.key(seed), (4, 3)), "b": {"c": jnp.arange(3.0)}}
    opt = optax.adamw(1e-3)
    return {"params": params, "opt_state": opt.init(params), "step": jnp.array(7, jnp.int32)}


def _equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_bitwise_with_optax_state(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=3, async_=True)
    state = _state()
    ck.save(3, state, {"step": 3, "note": "x"})
    ck.wait()
    restored, meta = ck.restore(None, _state(seed=1))
    _equal(restored, state)
    assert meta == {"step": 3, "note": "x"}
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)


def test_keep_n_and_latest(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=2, async_=False)
    assert ck.latest_step() is None
    for s in range(4):
        ck.save(s, _state(s), {"step": s})
    ck.wait()
    assert ck.latest_step() == 3
    assert sorted(ck.manager.all_steps()) == [2, 3]


def test_partial_checkpoint_is_never_resumed(tmp_path):
    ck = Checkpointer(str(tmp_path / "ck"), keep=5, async_=False)
    ck.save(2, _state(), {"step": 2})
    ck.wait()
    ck.close()
    # A save killed midway leaves orbax's temporary directory (and maybe junk) behind.
    partial = tmp_path / "ck" / "9.orbax-checkpoint-tmp-1234"
    partial.mkdir()
    (partial / "state").mkdir()
    (tmp_path / "ck" / "not_a_step").mkdir()
    ck2 = Checkpointer(str(tmp_path / "ck"), keep=5, async_=False)
    assert ck2.latest_step() == 2
    _, meta = ck2.restore(None, _state())
    assert meta["step"] == 2


def test_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        Checkpointer(str(f))
    with pytest.raises(ValueError, match="no complete checkpoint"):
        Checkpointer(str(tmp_path / "empty")).restore(None, _state())
    ck = Checkpointer(str(tmp_path / "ck"), async_=False)
    ck.save(0, _state(), {})
    ck.wait()
    with pytest.raises(ValueError, match="does not match"):
        ck.restore(0, {"params": {"w": jnp.zeros((9, 9))}})


def test_params_round_trip(tmp_path):
    params = _state()["params"]
    save_params(str(tmp_path / "p"), params)
    _equal(load_params(str(tmp_path / "p"), params), params)
    with pytest.raises(ValueError, match="no params checkpoint"):
        load_params(str(tmp_path / "missing"), params)
    assert os.path.isdir(tmp_path / "p")
