"""Every ModelConfig validation error names its field."""
import pytest

from stablerl_jax.config import ConfigError, ModelConfig


@pytest.mark.parametrize("field,value,needle", [
    ("vocab_size", 0, "positive int"),
    ("d_model", -1, "positive int"),
    ("num_layers", 1.5, "positive int"),
    ("num_heads", True, "positive int"),
    ("head_dim", 0, "positive int"),
    ("num_experts", 0, "positive int"),
    ("top_k", 0, "positive int"),
    ("expert_ffn_dim", 0, "positive int"),
    ("max_seq_len", 0, "positive int"),
    ("moe_tile", 0, "positive int"),
    ("num_kv_heads", 3, "must divide num_heads"),
    ("head_dim", 15, "even"),
    ("top_k", 9, "<= num_experts"),
    ("rope_theta", 0.0, "> 0"),
    ("norm_eps", 0.0, "(0, 1)"),
    ("init_std", -0.1, "> 0"),
    ("param_dtype", "float8", "one of"),
    ("compute_dtype", "int8", "one of"),
    ("dispatch", "sparse", "'grouped' or 'dense'"),
    ("router_z_loss_weight", -1.0, ">= 0"),
    ("router_aux_loss_weight", -1.0, ">= 0"),
    ("norm_topk_prob", 1, "true or false"),
])
def test_invalid_field_is_named(field, value, needle):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{field: value})
    assert str(e.value).startswith(field + ":")
    assert needle in str(e.value)


def test_defaults_valid_and_frozen():
    cfg = ModelConfig()
    with pytest.raises(AttributeError):
        cfg.d_model = 3
    assert cfg.replace(d_model=32).d_model == 32


def test_weight_replay_needs_r3():
    from stablerl_jax.config import RLConfig
    assert RLConfig(replay="r3", replay_weights=True).replay_weights
    for mode in ("none", "r2"):
        with pytest.raises(ConfigError, match="replay_weights: .* needs replay='r3'"):
            RLConfig(replay=mode, replay_weights=True)
