"""A new loss is one function and one row of the losses' table (docs/architecture.md, "Add a
loss"): the lists agree, every loss function has its row, a registered row is a config
choice, and each row's default aggregation and knobs are what its function reads. Rows
registered here under new names are removed again by monkeypatch."""
import dataclasses
import importlib
import inspect
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stablerl_jax import presets
from stablerl_jax.config import AGGREGATIONS, LOSS_NAMES, ConfigError, LossConfig, apply_overrides
from stablerl_jax.config.loss_table import LOSS_TABLE, SHARED_KNOBS, LossRow, loss_knobs, readers
from stablerl_jax.method import losses
from stablerl_jax.method.losses import LossBatch

# A value of each loss-specific knob that changes what a loss reading it computes on
# `_batch()`. A knob added to a row needs one here (test_every_knob_has_a_test_value).
OTHER_VALUE = {"eps_low": 0.05, "eps_high": 0.05, "cap_target": "engine",
               "clip_ratio_c": 1.5, "gspo_eps_low": 0.1, "gspo_eps_high": 0.1,
               "gspo_max_log_ratio": 0.05}
# Fields of LossConfig that are no loss's: the row's name, the advantages' settings and
# score centering's (applied around any loss, method/centering.py).
NOT_A_KNOB = ("name", "advantage", "advantage_std_ddof", "center", "center_k")


def test_the_lists_agree():
    """The table, `losses.LOSSES` and `config.LOSS_NAMES` name the same losses, in order,
    and LOSSES holds each row's function."""
    assert tuple(LOSS_TABLE) == tuple(losses.LOSSES) == LOSS_NAMES
    for name, row in LOSS_TABLE.items():
        assert losses.LOSSES[name] is row.load(), name


def test_every_loss_function_has_a_row():
    """A public function of losses.py with a loss's signature and no row would be a loss no
    config can name. (A row may name a function of another module.)"""
    signature = ["logp_BxT", "batch", "cfg"]
    defined = {fn for name, fn in vars(losses).items()
               if inspect.isfunction(fn) and not name.startswith("_")
               and fn.__module__ == losses.__name__
               and list(inspect.signature(fn).parameters) == signature}
    rows = {row.load() for row in LOSS_TABLE.values()}
    assert not sorted(fn.__name__ for fn in defined - rows), "no row in LOSS_TABLE"


def test_rows_are_well_formed():
    fields = {f.name for f in dataclasses.fields(LossConfig)}
    # Every LossConfig field is shared, some row's knob, or no loss's.
    assert set(SHARED_KNOBS) | set(loss_knobs(LOSS_TABLE)) | set(NOT_A_KNOB) == fields
    for name, row in LOSS_TABLE.items():
        assert list(inspect.signature(row.load()).parameters) == ["logp_BxT", "batch",
                                                                  "cfg"], name
        assert row.aggregation in AGGREGATIONS and set(row.knobs) <= fields, name
    with pytest.raises(AttributeError, match="defines no 'minirl_again'"):
        LossRow("stablerl_jax.method.losses:minirl_again", "token_mean").load()
    for bad, match in [(dict(fn="stablerl_jax.method.losses.minirl"), "module:attribute"),
                       (dict(aggregation="mean"), "aggregation"),
                       (dict(knobs=("clip",)), "SHARED_KNOBS")]:
        with pytest.raises(ValueError, match=match):
            LossRow(**{"fn": "stablerl_jax.method.losses:minirl", "aggregation": "token_mean",
                       **bad})


def test_every_knob_has_a_test_value():
    assert set(OTHER_VALUE) == set(loss_knobs(LOSS_TABLE))


@pytest.fixture
def new_rows(monkeypatch):
    """MiniRL's function under two new names: with a row-mean default and a token-mean one."""
    minirl = LOSS_TABLE["minirl"]
    monkeypatch.setitem(LOSS_TABLE, "minirl_again", minirl)
    monkeypatch.setitem(LOSS_TABLE, "minirl_tokens",
                        dataclasses.replace(minirl, aggregation="token_mean", knobs=()))


def test_a_new_row_is_a_config_choice(new_rows):
    assert LossConfig(name="minirl_again", cap_target="engine").name == "minirl_again"
    assert LossConfig(name="minirl_again", row_denominator="all").row_denominator == "all"
    # The config reads the row: its default aggregation and its knobs.
    with pytest.raises(ConfigError, match="^row_denominator: .*token_mean"):
        LossConfig(name="minirl_tokens", row_denominator="all")
    with pytest.raises(ConfigError, match="^cap_target: loss 'minirl_tokens' does not"):
        LossConfig(name="minirl_tokens", cap_target="engine")


def test_without_its_row_a_name_is_refused():
    with pytest.raises(ConfigError, match="^name: must be one of"):
        LossConfig(name="minirl_again")


def test_a_knob_the_loss_does_not_read_is_refused():
    for name, row in LOSS_TABLE.items():
        for knob, value in OTHER_VALUE.items():
            if knob in row.knobs:
                assert getattr(LossConfig(name=name, **{knob: value}), knob) == value
                continue
            with pytest.raises(ConfigError, match=f"^{knob}: loss '{name}' does not read "
                               f"it .*{readers(LOSS_TABLE, knob)[0]}"):
                LossConfig(name=name, **{knob: value})
    # Overrides apply together, in any order, then validate once.
    cfg = apply_overrides(presets.tiny(), ["loss.gspo_eps_high=1e-3", "loss.name=gspo"])
    assert (cfg.loss.name, cfg.loss.gspo_eps_high) == ("gspo", 1e-3)


def _batch():
    """Eight responses of six tokens with both signs of Â, ratios π_θ/π_old spread over
    about e^±1 and an engine mismatch, so that each knob of OTHER_VALUE binds somewhere."""
    k = jax.random.split(jax.random.key(0), 4)
    logp = jnp.log(jax.random.uniform(k[0], (8, 6), jnp.float32, 0.05, 1.0))
    old = logp + 0.5 * jax.random.normal(k[1], (8, 6))
    mu = old + 0.5 * jax.random.normal(k[2], (8, 6))
    mask = (jax.random.uniform(k[3], (8, 6)) < 0.8).astype(jnp.float32)
    return logp, LossBatch(old, mu, mask, advantages_B=jnp.linspace(-1.0, 1.0, 8))


def _run(name, cfg):
    logp, batch = _batch()
    (v, metrics), g = jax.value_and_grad(lambda lp: losses.LOSSES[name](lp, batch, cfg),
                                         has_aux=True)(logp)
    return jax.tree.map(np.asarray, (v, g, metrics))


def _set(cfg, **kw):
    """`cfg` with fields set past LossConfig's checks (a knob the loss does not read)."""
    out = dataclasses.replace(cfg)
    for k, v in kw.items():
        object.__setattr__(out, k, v)
    return out


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_a_row_lists_exactly_the_knobs_its_loss_reads(name):
    """A knob off the row leaves value, gradient and metrics bit for bit as they were; each
    knob on it changes the value or the gradient. tis_cap = 1.5 makes the IS cap bind, so
    cap_target matters."""
    base = LossConfig(name=name, tis_cap=1.5)
    v0, g0, m0 = _run(name, base)
    for knob, value in OTHER_VALUE.items():
        v, g, m = _run(name, _set(base, **{knob: value}))
        if knob in LOSS_TABLE[name].knobs:
            assert v != v0 or not np.array_equal(g, g0), knob
        else:
            np.testing.assert_array_equal(v, v0, err_msg=knob)
            np.testing.assert_array_equal(g, g0, err_msg=knob)
            assert jax.tree.all(jax.tree.map(np.array_equal, m, m0)), knob


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_the_row_aggregation_is_the_default(name):
    """aggregation=None runs the row's aggregation, bit for bit, and no other."""
    row = LOSS_TABLE[name]
    v0, g0, _ = _run(name, LossConfig(name=name))
    for aggregation in AGGREGATIONS:
        v, g, _ = _run(name, LossConfig(name=name, aggregation=aggregation))
        if aggregation == row.aggregation:
            np.testing.assert_array_equal(v, v0)
            np.testing.assert_array_equal(g, g0)
        else:
            assert v != v0, aggregation


def test_the_old_import_name_warns_and_is_the_same_table():
    sys.modules.pop("stablerl_jax.method.loss_table", None)
    with pytest.warns(DeprecationWarning, match="stablerl_jax.config.loss_table"):
        old = importlib.import_module("stablerl_jax.method.loss_table")
    assert old.LOSS_TABLE is LOSS_TABLE and old.LossRow is LossRow
