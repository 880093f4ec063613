"""config.json ↔ ModelConfig: the Qwen3-30B-A3B config maps field by field (both the
transformers 4 and 5 spellings), round trips, and what the model cannot run is refused
naming the field."""
import pytest

from stablerl_jax.config import ConfigError
from stablerl_jax.interop.hf_config import hf_config_from_model, model_config_from_hf

# Qwen3-30B-A3B's config.json, as released (transformers 4 spelling).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_qwen3_30b_a3b_maps_to_the_paper_model():
    cfg = model_config_from_hf(QWEN3_30B_A3B)
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.num_experts, cfg.top_k, cfg.expert_ffn_dim) == (
        151936, 2048, 48, 32, 4, 128, 128, 8, 768)
    assert cfg.norm_topk_prob and not cfg.tie_embeddings
    assert (cfg.rope_theta, cfg.norm_eps, cfg.max_seq_len, cfg.param_dtype) == (
        1e6, 1e-6, 40960, "bfloat16")
    # output_router_logits is false: HF trains this config without the balancing loss.
    assert cfg.router_aux_loss_weight == 0.0
    aux = model_config_from_hf({**QWEN3_30B_A3B, "output_router_logits": True})
    assert aux.router_aux_loss_weight == 0.001 * 8  # HF's coefficient × K (module doc)


def test_transformers_5_spelling_and_the_round_trip():
    v5 = {k: v for k, v in QWEN3_30B_A3B.items()
          if k not in ("num_experts", "rope_theta", "rope_scaling", "torch_dtype")}
    v5.update(num_local_experts=128, dtype="bfloat16",
              rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    cfg = model_config_from_hf(v5)
    assert cfg == model_config_from_hf(QWEN3_30B_A3B)
    assert model_config_from_hf(hf_config_from_model(cfg)) == cfg
    assert model_config_from_hf(QWEN3_30B_A3B, max_seq_len=4096).max_seq_len == 4096


@pytest.mark.parametrize("change,field", [
    ({"model_type": "qwen3"}, "model_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_only_layers": [0, 1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_what_the_model_cannot_run_is_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        model_config_from_hf({**QWEN3_30B_A3B, **change})


@pytest.mark.parametrize("change,needle", [
    ({"vocab_size": float("inf")}, "vocab_size: must be an int >= 1"),
    ({"vocab_size": [151936]}, "vocab_size: must be an int >= 1"),
    ({"vocab_size": "151936"}, "vocab_size: must be an int >= 1"),
    ({"num_hidden_layers": 47.5}, "got 47.5"),
    # transformers writes ints, and its own config class refuses 2.0 as well.
    ({"num_hidden_layers": 48.0}, "got 48.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers: must be an int"),
    ({"num_hidden_layers": 2**31}, "<= 2147483647"),
    ({"moe_intermediate_size": -768}, "moe_intermediate_size: must be an int >= 1"),
    ({"max_position_embeddings": 0}, "max_position_embeddings: must be an int >= 1"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step: must be an int >= 1"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads: must be an int >= 1"),
    ({"num_attention_heads": 4096, "head_dim": None},
     "num_attention_heads: 4096 is more than hidden_size=2048"),
    ({"num_key_value_heads": 5}, "num_key_value_heads: must divide num_attention_heads=32"),
    ({"head_dim": 127}, "head_dim: must be even"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok: must be <= num_experts=128"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps: must be a finite number in (0, 1)"),
    ({"rms_norm_eps": 1.5}, "rms_norm_eps: must be a finite number in (0, 1)"),
    ({"rope_theta": -1.0}, "rope_theta: must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "rope_parameters: rope_theta: must be a finite number > 0"),
    ({"router_aux_loss_coef": float("-inf")}, "router_aux_loss_coef: must be a finite"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings: must be true or false"),
    ({"norm_topk_prob": 1}, "norm_topk_prob: must be true or false"),
    ({"torch_dtype": 16}, "torch_dtype: must be a string"),
    ({"rope_scaling": "yarn"}, "rope_scaling: must be a JSON object or null"),
    ({"mlp_only_layers": 3}, "mlp_only_layers: must be a list"),
])
def test_ill_typed_or_out_of_range_fields_are_refused_naming_field_and_file(change, needle):
    hf = {k: v for k, v in {**QWEN3_30B_A3B, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        model_config_from_hf(hf, source="/ckpt/config.json")
    msg = str(e.value)
    assert msg.startswith("/ckpt/config.json: ") and needle in msg, msg
    assert "correct it in config.json" in msg or "set head_dim" in msg, msg


def test_a_config_json_that_is_not_an_object_is_refused():
    with pytest.raises(ConfigError, match=r"/ckpt/config.json: must hold a JSON object"):
        model_config_from_hf([QWEN3_30B_A3B], source="/ckpt/config.json")
