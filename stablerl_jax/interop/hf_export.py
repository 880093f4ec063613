"""Hugging Face Qwen3-MoE safetensors checkpoints out (`save_qwen3_moe`): weights in either
expert layout (hf_layout.py), config.json, tokenizer files and generation_config.json, a
directory servable as is that `load_qwen3_moe` (hf_checkpoint.py) reads back bit for bit.
The embeddings and final norm, then each layer, are gathered to the host in turn and
written as one safetensors file each, plus `model.safetensors.index.json` (single process;
multi-host would gather each layer with `jax.experimental.multihost_utils.process_allgather`).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import save

from stablerl_jax.config import ModelConfig
from stablerl_jax.data.hf_tokenizer import read_json
from stablerl_jax.interop.hf_config import hf_config_from_model
from stablerl_jax.interop.hf_layout import LAYER, PER_EXPERT, PREFIX
from stablerl_jax.runs import storage

# What transformers' tokenizer `save_pretrained` writes and `from_pretrained` reads: the
# fast tokenizer, its config, the chat template (transformers 5 writes it to
# chat_template.jinja, not into tokenizer_config.json, and named extra templates to
# additional_chat_templates/), the legacy added-token / special-token maps, and the
# vocabulary files of slow BPE / SentencePiece tokenizers. generation_config.json is
# written, not copied (`generation_config`).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json",
                    "merges.txt", "tokenizer.model")
_TOKENIZER_DIRS = ("additional_chat_templates",)


def _to_hf(x: np.ndarray, how: str, cfg: ModelConfig) -> np.ndarray:
    """Inverse of `hf_checkpoint._read` for a whole (unstacked) tensor."""
    if how == "as_is":
        return x
    if how == "transposed":
        return np.swapaxes(x, -1, -2)
    if how == "in_heads":  # [D, H, Dh] -> [H·Dh, D]
        return x.transpose(1, 2, 0).reshape(-1, x.shape[0])
    if how == "heads_in":  # [H, Dh, D] -> [D, H·Dh]
        return x.transpose(2, 0, 1).reshape(x.shape[2], -1)
    raise ValueError(how)


def save_qwen3_moe(params: dict, cfg: ModelConfig, path: str, *, experts: str = "per_expert",
                   config_extra: dict | None = None, tokenizer_dir: str = "",
                   stop_ids: tuple[int, ...] = ()) -> None:
    """Write `params` as a Qwen3MoeForCausalLM checkpoint (module docstring), config.json
    from `hf_config.hf_config_from_model(cfg, **config_extra)`, tensors in their dtype so
    `load_qwen3_moe` returns them bit for bit. experts: 'per_expert' (released) or 'fused'
    (hf_layout.py); tokenizer_dir: its `_TOKENIZER_FILES` are copied; stop_ids
    (`Tokenizer.stop_ids`): generation_config.json's "eos_token_id" (`generation_config`)."""
    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts={experts!r} must be 'per_expert' or 'fused'")
    storage.makedirs(path)  # `path` may be a gs:// directory (storage.py)
    n_files = cfg.num_layers + 1
    fname = lambda i: f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
    weight_map, total = {}, 0

    def write(i, tensors):
        nonlocal total
        tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        storage.write_bytes(os.path.join(path, fname(i)),
                            save(tensors, metadata={"format": "pt"}))
        weight_map.update({k: fname(i) for k in tensors})
        total += sum(v.nbytes for v in tensors.values())

    host = lambda x: np.asarray(jax.device_get(x))
    top = {"model.embed_tokens.weight": host(params["embed"]),
           "model.norm.weight": host(params["final_norm"])}
    if not cfg.tie_embeddings:
        top["lm_head.weight"] = host(params["unembed"]).T
    write(0, top)
    for l in range(cfg.num_layers):
        layer = {k: host(v[l]) for k, v in params["layers"].items()}
        out = {PREFIX.format(l=l) + n: _to_hf(layer[k], how, cfg) for k, (n, how) in LAYER.items()}
        if experts == "fused":
            out[PREFIX.format(l=l) + "mlp.experts.gate_up_proj"] = np.concatenate(
                [layer["w_gate"].transpose(0, 2, 1), layer["w_up"].transpose(0, 2, 1)], axis=1)
            out[PREFIX.format(l=l) + "mlp.experts.down_proj"] = layer["w_down"].transpose(0, 2, 1)
        else:
            for k, n in PER_EXPERT.items():
                for e in range(cfg.num_experts):
                    out[(PREFIX + n).format(l=l, e=e)] = layer[k][e].T
        write(l + 1, out)
    storage.write_text(os.path.join(path, "model.safetensors.index.json"), json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    storage.write_text(os.path.join(path, "config.json"), json.dumps(
        hf_config_from_model(cfg, **(config_extra or {})), indent=2))
    for name in _TOKENIZER_FILES if tokenizer_dir else ():
        if storage.isfile(os.path.join(tokenizer_dir, name)):
            storage.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    for name in _TOKENIZER_DIRS if tokenizer_dir else ():
        if storage.isdir(os.path.join(tokenizer_dir, name)):
            storage.copytree(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    source = os.path.join(tokenizer_dir, "generation_config.json") if tokenizer_dir else ""
    generation = generation_config(read_json(source) if source else {},
                                   stop_ids, config_extra or {})
    if generation:
        storage.write_text(os.path.join(path, "generation_config.json"),
                           json.dumps(generation, indent=2))


def generation_config(source: dict, stop_ids: tuple[int, ...], config_extra: dict) -> dict:
    """The exported generation_config.json: `source`'s (sampling settings such as top_p
    kept) with "eos_token_id" = every stop id (an int if one; none: config_extra's) and
    config_extra's "pad_token_id" / "bos_token_id", where not None. Serving stacks
    (transformers' generate, vLLM, SGLang) stop on these ids, so a response ends where the
    run's sampler ended it; config.json keeps eos_id alone."""
    eos = list(stop_ids) or config_extra.get("eos_token_id")
    ids = {"eos_token_id": eos[0] if isinstance(eos, list) and len(eos) == 1 else eos,
           "pad_token_id": config_extra.get("pad_token_id"),
           "bos_token_id": config_extra.get("bos_token_id")}
    return {**source, **{k: v for k, v in ids.items() if v is not None}}
