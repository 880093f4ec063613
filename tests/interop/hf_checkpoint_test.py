"""Hugging Face Qwen3-MoE checkpoints: save → load is bit-exact in both expert layouts,
tied and untied, float32 and bfloat16; a load sharded over a 2×2×2 mesh equals the
unsharded one and lands on the rules table's shardings; a checkpoint this model cannot
hold is refused naming the tensor. (Logit parity with transformers: hf_parity_test.py.)"""
import json
import os

import jax
import numpy as np
import pytest
from conftest import cpu_devices
from safetensors.numpy import load_file, save_file

from stablerl_jax import sharding
from stablerl_jax.config import ModelConfig
from stablerl_jax.interop import hf_checkpoint as hc
from stablerl_jax.interop.hf_export import save_qwen3_moe
from stablerl_jax.model import transformer as tf

CFG = ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, num_experts=8, top_k=2, expert_ffn_dim=16, max_seq_len=64)


def _assert_same(a, b):
    """Bit-exact: same tree, dtypes and values."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("experts,tied,dtype", [("per_expert", False, "float32"),
                                                ("fused", True, "bfloat16")])
def test_save_then_load_is_bit_exact(tmp_path, experts, tied, dtype):
    cfg = CFG.replace(tie_embeddings=tied, param_dtype=dtype, norm_topk_prob=not tied)
    params = tf.init_params(jax.random.key(0), cfg)
    save_qwen3_moe(params, cfg, str(tmp_path), experts=experts)
    loaded, cfg2 = hc.load_qwen3_moe(str(tmp_path))
    # Every field config.json carries comes back; the others are run settings.
    assert cfg2 == cfg
    _assert_same(loaded, params)
    names = json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"]
    fused = "model.layers.0.mlp.experts.gate_up_proj" in names
    assert fused == (experts == "fused")
    assert ("lm_head.weight" in names) == (not tied)


def test_loading_a_saved_checkpoint_and_saving_it_again_reproduces_its_files(tmp_path):
    params = tf.init_params(jax.random.key(1), CFG)
    save_qwen3_moe(params, CFG, str(tmp_path / "a"))
    loaded, cfg = hc.load_qwen3_moe(str(tmp_path / "a"))
    save_qwen3_moe(loaded, cfg, str(tmp_path / "b"))
    for name in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_sharded_load_equals_unsharded_and_uses_the_rules_table(tmp_path):
    params = tf.init_params(jax.random.key(2), CFG)
    save_qwen3_moe(params, CFG, str(tmp_path))
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices())
    loaded, _ = hc.load_qwen3_moe(str(tmp_path), mesh=mesh)
    want = sharding.tree_shardings(tf.param_logical_axes(CFG), params, mesh)
    for x, sh in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
        assert x.sharding == sh
    assert loaded["layers"]["w_gate"].sharding.spec == jax.sharding.PartitionSpec(
        None, "expert", "fsdp", None)
    _assert_same(jax.device_get(loaded), jax.device_get(params))


def test_a_single_file_checkpoint_loads_too(tmp_path):
    params = tf.init_params(jax.random.key(3), CFG)
    save_qwen3_moe(params, CFG, str(tmp_path / "sharded"))
    merged = {}
    for name in sorted(os.listdir(tmp_path / "sharded")):
        if name.endswith(".safetensors"):
            merged.update(load_file(str(tmp_path / "sharded" / name)))
    os.makedirs(tmp_path / "one")
    save_file(merged, str(tmp_path / "one" / "model.safetensors"))
    (tmp_path / "one" / "config.json").write_text(
        (tmp_path / "sharded" / "config.json").read_text())
    loaded, _ = hc.load_qwen3_moe(str(tmp_path / "one"))
    _assert_same(loaded, params)


def _rewrite(path, change):
    """Apply `change(tensors)` to the single-file copy of the checkpoint at path."""
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
            os.remove(os.path.join(path, name))
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    change(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def test_unusable_checkpoints_are_refused_naming_the_tensor(tmp_path):
    params = tf.init_params(jax.random.key(4), CFG)
    for case in ("bias", "missing", "shape"):
        d = str(tmp_path / case)
        save_qwen3_moe(params, CFG, d)
        if case == "bias":
            _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias":
                                            np.zeros(32, np.float32)}))
            with pytest.raises(ValueError, match="q_proj.bias"):
                hc.load_qwen3_moe(d)
        elif case == "missing":
            _rewrite(d, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
            with pytest.raises(ValueError, match="experts.3.up_proj.weight is missing"):
                hc.load_qwen3_moe(d)
        else:
            with pytest.raises(ValueError, match="q_proj.weight has shape"):
                hc.load_qwen3_moe(d, num_heads=2, num_kv_heads=2)


def test_every_model_field_is_read_from_config_json_or_kept(tmp_path):
    """experiment_with_checkpoint: each ModelConfig field (enumerated, so a new field is
    covered) is either one config.json defines (hf_config.checkpoint_fields), taken from
    the checkpoint, or kept from the run's config, param_dtype (the master weights) among
    them. The run's config sets every kept field to a value the checkpoint's differs from."""
    import dataclasses

    from stablerl_jax.config import ExperimentConfig
    from stablerl_jax.interop import hf_config
    # The checkpoint's own run fields (dense dispatch) never reach config.json.
    ckpt = CFG.replace(param_dtype="bfloat16", norm_topk_prob=False, rope_theta=5e5,
                       dispatch="dense")
    save_qwen3_moe(tf.init_params(jax.random.key(5), ckpt), ckpt, str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf == hf_config.hf_config_from_model(ckpt)
    run_model = ModelConfig(
        param_dtype="float32", compute_dtype="bfloat16", init_std=0.05, remat="dots",
        dispatch="grouped", moe_tile=16, gmm_impl="tiles", expert_parallel=True,
        unroll_layers=True, attention_impl="chunked", attention_chunk=8,
        kv_cache_layout="bksd", decode_block=4, decode_attention_impl="pallas_tpu",
        router_z_loss_weight=1e-3, batch_invariant=True, router_dtype="float32",
        row_tile=8)
    from_json = set(hf_config.checkpoint_fields(hf))
    kept = {f.name for f in dataclasses.fields(ModelConfig)} - from_json | set(hc.RUN_CHOSEN)
    assert all(getattr(run_model, f) != getattr(ckpt, f) for f in kept), \
        "give every kept field a value here that differs from the checkpoint's"
    got = hc.experiment_with_checkpoint(ExperimentConfig(model=run_model), str(tmp_path)).model
    for f in dataclasses.fields(ModelConfig):
        want = run_model if f.name in kept else ckpt
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert got.param_dtype == "float32" and hc.checkpoint_dtype(str(tmp_path)) == "bfloat16"


@pytest.mark.parametrize("experts", ["per_expert", "fused"])
def test_a_config_json_that_disagrees_with_the_weights_is_refused_naming_the_field(
        tmp_path, experts):
    """Each architecture field config.json states is compared with the weights' names
    and headers before anything is built: the error names the field, config.json's path,
    what the weights hold, and the value to set."""
    save_qwen3_moe(tf.init_params(jax.random.key(6), CFG), CFG, str(tmp_path),
                   experts=experts)
    good = json.loads((tmp_path / "config.json").read_text())
    cases = [("num_hidden_layers", 3, 2), ("num_hidden_layers", 10**6, 2),
             ("vocab_size", 97, 96), ("hidden_size", 48, 32), ("head_dim", 16, 8),
             ("num_attention_heads", 8, 4), ("num_key_value_heads", 4, 2),
             ("num_experts", 16, 8), ("moe_intermediate_size", 32, 16)]
    for field, bad, held in cases:
        (tmp_path / "config.json").write_text(json.dumps({**good, field: bad}))
        with pytest.raises(ValueError) as e:
            hc.load_qwen3_moe(str(tmp_path))
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 'config.json'}: {field} is {bad}, but the "
                              f"weights hold {held} "), msg
        assert f"set {field} to {held}" in msg, msg
    (tmp_path / "config.json").write_text(json.dumps(good))
    assert hc.check_config_against_weights(str(tmp_path)) == hc.hf_config.checkpoint_fields(good)


def test_an_index_that_names_a_missing_shard_is_refused(tmp_path):
    save_qwen3_moe(tf.init_params(jax.random.key(7), CFG), CFG, str(tmp_path))
    os.remove(tmp_path / "model-00002-of-00003.safetensors")
    with pytest.raises(FileNotFoundError, match="lists model-00002-of-00003.safetensors, "
                                                "which is not in"):
        hc.load_qwen3_moe(str(tmp_path))


@pytest.mark.parametrize("index, needle", [
    ("[1, 2]", "must be a JSON object whose weight_map maps each tensor name to a file name"),
    ('{"weight_map": {"model.norm.weight": "/etc/passwd"}}', "a file name in this directory"),
    ('{"weight_map": {"model.norm.weight": "../x.safetensors"}}', "in this directory"),
    ('{"weight_map": {"model.norm.weight": "model-00001-of-00003.safetensors"}}',
     "no model.layers.* tensors"),
    ("a shard that is config.json", "config.json: not a readable safetensors file"),
])
def test_a_hostile_shard_index_is_refused_naming_it(tmp_path, index, needle):
    save_qwen3_moe(tf.init_params(jax.random.key(8), CFG), CFG, str(tmp_path))
    path = tmp_path / "model.safetensors.index.json"
    if index == "a shard that is config.json":
        index = json.loads(path.read_text())
        index["weight_map"]["model.embed_tokens.weight"] = "config.json"
        index = json.dumps(index)
    path.write_text(index)
    with pytest.raises(ValueError, match=needle):
        hc.load_qwen3_moe(str(tmp_path))
