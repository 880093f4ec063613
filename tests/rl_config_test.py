"""Experiment presets and key=value overrides."""
import pytest

from stablerl_jax.config import ConfigError
from stablerl_jax.rl import config as C


def test_presets_validate():
    tiny = C.preset("tiny")
    paper = C.preset("paper")
    assert paper.model.num_experts == 128 and paper.model.top_k == 8
    assert paper.rl.group_size == 16 and paper.rl.inference == "fp8"
    assert paper.rl.prompts_per_step * paper.rl.group_size == 1024
    assert tiny.loss.name == "minirl" and tiny.loss.tis_cap == 5.0


def test_overrides_parse_by_field_type():
    cfg = C.preset("tiny", ["rl.num_minibatches=4", "loss.clip=false", "rl.replay=r3",
                            "rl.learning_rate=2e-5", "rl.mesh=2,2,2", "name=x",
                            "loss.aggregation=seq_mean_token_mean"])
    assert cfg.rl.num_minibatches == 4 and cfg.loss.clip is False and cfg.rl.replay == "r3"
    assert cfg.rl.learning_rate == 2e-5 and cfg.rl.mesh == (2, 2, 2) and cfg.name == "x"
    assert cfg.loss.aggregation == "seq_mean_token_mean"


@pytest.mark.parametrize("override,needle", [
    ("rl.replay=r4", "replay:"),
    ("rl.num_minibatches=3", "num_minibatches:"),
    ("rl.bogus=1", "unknown field"),
    ("nosection=1", "section.field"),
    ("rl.steps=abc", "cannot parse"),
    ("loss.clip=maybe", "true/false"),
    ("rl.inference=train", "inference:"),
    ("rl.adam_eps=0", "adam_eps:"),
    ("model.vocab_size=65", "model.vocab_size"),
    ("sampling.max_new_tokens=100", "model.max_seq_len"),
    ("rl.steps", "expected section.field=value"),
])
def test_bad_overrides_are_clear_errors(override, needle):
    with pytest.raises(ConfigError, match=needle):
        C.preset("tiny", [override])
    with pytest.raises(ConfigError, match="unknown 'huge'"):
        C.preset("huge")
