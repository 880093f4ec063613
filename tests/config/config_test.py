"""Every ModelConfig validation error names its field."""
import pytest

from stablerl_jax.config import (ConfigError, ExperimentConfig, ModelConfig, changed_fields,
                                 flat_dict)


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


def test_eval_sets_parse_and_validate():
    from stablerl_jax.config import RLConfig, parse_eval_sets
    assert parse_eval_sets("") == {}
    assert parse_eval_sets("aime24:/d/a.jsonl, hmmt_25:/d/h") == {"aime24": "/d/a.jsonl",
                                                                "hmmt_25": "/d/h"}
    assert parse_eval_sets("c:C:/x/t.jsonl") == {"c": "C:/x/t.jsonl"}  # the first ':' splits
    for spec, needle in [("aime", "must be name:path"), ("a:", "must be name:path"),
                         ("a b:/x", "letters, digits"), ("a:/x,a:/y", "appears twice")]:
        with pytest.raises(ConfigError, match=f"eval_sets: .*{needle}"):
            RLConfig(eval_sets=spec)


@pytest.mark.parametrize("kw, needle", [
    ({"format": "csv"}, "format: must be one of"),
    ({"format": "custom", "prompt_field": "q"}, "format: 'custom' needs"),
    ({"prompt_field": "q"}, "prompt_field: is only read with task.format=custom"),
    ({"chat_template": 1}, "chat_template: must be true or false"),
    ({"kind": "jsonl"}, "jsonl_dir: must name"),
])
def test_task_data_fields_are_checked(kw, needle):
    from stablerl_jax.config import TaskConfig
    with pytest.raises(ConfigError, match=needle):
        TaskConfig(**kw)


def test_new_task_and_eval_fields_survive_overrides():
    from stablerl_jax import presets
    cfg = presets.preset("tiny", [
        "task.kind=jsonl", "task.jsonl_dir=/d", "task.format=custom", "task.prompt_field=Q",
        "task.answer_field=A", "task.solution_field=S", "task.tokenizer_dir=/t",
        "task.chat_template=true", "task.system_prompt=Be brief.",
        "task.prompt_template={question} Put the answer in \\boxed{}.",
        "task.enable_thinking=false", "task.add_generation_prompt=false",
        "rl.eval_sets=aime24:/a,hmmt:/h.jsonl"])
    t = cfg.task
    assert (t.format, t.prompt_field, t.answer_field, t.solution_field) == ("custom", "Q", "A",
                                                                             "S")
    assert t.chat_template and not t.enable_thinking and not t.add_generation_prompt
    assert t.prompt_template == "{question} Put the answer in \\boxed{}."
    assert t.system_prompt == "Be brief." and cfg.rl.eval_sets == "aime24:/a,hmmt:/h.jsonl"


def test_a_field_added_after_a_run_was_saved_is_unchanged_at_its_default():
    cfg = ExperimentConfig()
    saved = flat_dict(cfg)
    del saved["rl.overlong"]  # a run saved before the field existed
    assert changed_fields(saved, cfg) == []
    assert changed_fields(saved, cfg.replace(rl=cfg.rl.replace(overlong="mask"))) == [
        "rl.overlong"]
    saved["rl.removed_field"] = 1  # a field the code no longer has is a change
    assert changed_fields(saved, cfg) == ["rl.removed_field"]
