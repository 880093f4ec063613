"""Settings valid alone that cannot give together what they promise (config/
combinations.py), sizes bounded by what a run can use, and every float setting of every
section checked in float32 (config/checks.check_float_range)."""
import dataclasses

import pytest

from stablerl_jax import presets
from stablerl_jax.config import ConfigError
from stablerl_jax.config import checks, combinations
from stablerl_jax.config.experiment import ExperimentConfig


def _refused(overrides, *needles):
    with pytest.raises(ConfigError) as e:
        presets.preset("tiny", overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


@pytest.mark.parametrize("router", ["bfloat16", "float16", "float64"])
def test_bitwise_with_another_sampler_router_dtype_is_refused(router):
    _refused(["sampling.numerics=bitwise", f"sampling.router_dtype={router}"],
             f"sampling.router_dtype: {router!r} under sampling.numerics='bitwise'",
             "sampling.router_dtype=''", "sampling.numerics='exact'")


def test_bitwise_with_the_trainers_router_dtype_or_a_dial_is_accepted():
    for overrides in (["sampling.router_dtype=float32"],
                      ["model.router_dtype=bfloat16", "sampling.router_dtype=bfloat16"],
                      ["sampling.router_noise_std=0.1"], ["sampling.act_fp8=true"]):
        cfg = presets.preset("tiny", ["sampling.numerics=bitwise", *overrides])
        assert cfg.sampling.numerics == "bitwise"
    # The same knob under another preset is a mismatch by choice.
    presets.preset("tiny", ["sampling.numerics=exact", "sampling.router_dtype=bfloat16"])



def test_bitwise_numerics_need_per_token_layers_which_their_override_sets():
    """Under 'bitwise' both engines compute per token (model.batch_invariant). The config
    never rewrites a section after construction: an override of sampling.numerics sets
    the model's flag with it, and a config built with bitwise numerics and the flag off
    is refused in one line, as is an override that turns it off."""
    tiny = presets.preset("tiny")
    assert not tiny.model.batch_invariant
    assert presets.preset("tiny", ["sampling.numerics=bitwise"]).model.batch_invariant
    with pytest.raises(ConfigError) as e:
        tiny.replace(sampling=tiny.sampling.replace(numerics="bitwise"))
    assert str(e.value).startswith("model.batch_invariant: must be true under "
                                   "sampling.numerics='bitwise'")
    assert "set model.batch_invariant=true" in str(e.value)
    _refused(["sampling.numerics=bitwise", "model.batch_invariant=false"],
             "model.batch_invariant: must be true")
    both = tiny.replace(model=tiny.model.replace(batch_invariant=True),
                        sampling=tiny.sampling.replace(numerics="bitwise"))
    assert both.model.batch_invariant and both.sampling.numerics == "bitwise"
    # Per-token layers under other numerics are a valid choice, left as set.
    assert presets.preset("tiny", ["model.batch_invariant=true"]).sampling.numerics != "bitwise"

def test_bitwise_with_an_offline_rollout_file_is_refused():
    _refused(["sampling.numerics=bitwise", "rl.offline_rollouts=r.npz"],
             "sampling.numerics: 'bitwise' promises μ = π_old", "rl.offline_rollouts=''")
    presets.preset("tiny", ["sampling.numerics=exact", "rl.offline_rollouts=r.npz"])


@pytest.mark.parametrize("field", ["row_tile", "decode_block", "moe_tile"])
def test_a_tile_past_what_a_forward_can_fill_is_refused(field):
    cfg = presets.preset("tiny")
    most = combinations.forward_tokens(cfg) * (cfg.model.top_k if field == "moe_tile" else 1)
    presets.preset("tiny", ["sampling.numerics=bitwise", f"model.{field}={most}"])
    for v in (most + 1, 2**31 - 1):
        _refused(["sampling.numerics=bitwise", f"model.{field}={v}"],
                 f"model.{field}: {v:,} is more than any forward", f"at most {most:,}")


def _float_fields():
    """(section class, field) of every float field of every section, nested ones too."""
    out = []

    def walk(cls):
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name)
            if dataclasses.is_dataclass(default):
                walk(type(default))
            elif isinstance(default, float):
                out.append((cls, f.name))
    walk(ExperimentConfig)
    return out


FLOATS = _float_fields()
LIMITS = (1e308, -1e308, 3.5e38, 1e-50, -1e-45)  # past float32's max; below its normals


def test_every_section_has_float_settings_in_the_table():
    assert {cls.__name__ for cls, _ in FLOATS} == {
        "ModelConfig", "SamplingConfig", "LossConfig", "OptimConfig", "RLConfig",
        "TaskConfig"}


def test_every_float_setting_is_checked_in_float32():
    """Every float field of every section at float32's limits: refused naming the field
    (a range shared with another field names both), by the section's own range or by
    the float32 rule. Sections are built alone: the command line adds the section's
    path (test_the_float32_rule_names_the_limits)."""
    for cls, name in FLOATS:
        for value in LIMITS:
            with pytest.raises(ConfigError) as e:
                cls(**{name: value})
            assert name in str(e.value), (cls.__name__, name, value, str(e.value))


def test_the_float32_rule_names_the_limits():
    msg = _refused(["sampling.router_noise_std=1e308"], "sampling.router_noise_std: 1e+308",
                   "not a finite float32", f"{checks.FLOAT32_MAX:.4g}")
    assert "router_noise_std" in msg
    _refused(["rl.optim.learning_rate=1e-50"], "rl.optim.learning_rate: 1e-50",
             "not a finite float32")
    cfg = presets.preset("tiny", ["sampling.router_noise_std=3e38"])  # finite in float32
    assert cfg.sampling.router_noise_std == 3e38
