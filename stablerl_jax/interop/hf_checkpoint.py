"""Hugging Face Qwen3-MoE safetensors checkpoints in (`load_qwen3_moe`, by the name map of
hf_layout.py; out: hf_export.py, `save_qwen3_moe`).

Loading builds no host copy of the model: each parameter is a
`jax.make_array_from_callback` on its sharding, whose callback reads one device's block
from only that block's rows of its HF tensors (`safe_open(...).get_slice`, memory-mapped),
stacking layers and experts on the fly. Every tensor must be used: an unexpected one (a
bias, an FP8 scale, a dense MLP) is an error naming it, never silently dropped, as is one
whose dtype is not config.json's `torch_dtype` or that holds NaN or inf (hf_validate.py).
First config.json is checked field by field (hf_config.py) and against the weights' names
and headers (`check_config_against_weights`), each error naming the field and the file.
"""
from __future__ import annotations

import glob
import os
import re

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors' numpy reader needs it)
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from stablerl_jax import sharding
from stablerl_jax.config import ExperimentConfig, ModelConfig
from stablerl_jax.data.hf_tokenizer import read_json
from stablerl_jax.interop import hf_config, hf_validate

# Re-exported: the way out beside the way in (docs/guides/interop.md, rl/loop.py).
from stablerl_jax.interop.hf_layout import FUSED, LAYER, PER_EXPERT, PREFIX
from stablerl_jax.model import transformer as tf
from stablerl_jax.model.numerics import dtype_of
from stablerl_jax.runs import storage

# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _safe_open(path: str):
    try:
        return safe_open(path, "numpy")
    except SafetensorError as e:  # a damaged header is not a bug of ours: name the file
        raise ValueError(f"{path}: not a readable safetensors file ({e}); restore it from "
                         "the checkpoint's source") from None


class _Checkpoint:
    """Name → file of a checkpoint directory, with lazily opened memory-mapped readers."""

    def __init__(self, path: str):
        storage.check_local(path, "Hugging Face checkpoint")  # memory-mapped safetensors
        index = os.path.join(path, "model.safetensors.index.json")
        self.path, self.listing = path, index
        if os.path.exists(index):
            files = read_json(index)
            files = files.get("weight_map") if isinstance(files, dict) else None
            # A shard is a file of this directory: a path elsewhere is never opened.
            if not (isinstance(files, dict) and all(
                    isinstance(v, str) and v == os.path.basename(v) and v not in ("", ".", "..")
                    for v in files.values())):
                raise ValueError(f"{index}: must be a JSON object whose weight_map maps each "
                                 "tensor name to a file name in this directory; restore the "
                                 "checkpoint's index")
            self.where = {n: os.path.join(path, fn) for n, fn in files.items()}
            for p in sorted(set(self.where.values())):
                if not os.path.isfile(p):
                    raise FileNotFoundError(f"{index} lists {os.path.basename(p)}, which is "
                                            f"not in {path}; copy the checkpoint whole")
        else:
            self.listing = os.path.join(path, "*.safetensors")
            paths = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not paths:
                raise FileNotFoundError(f"{path}: no *.safetensors files and no "
                                        "model.safetensors.index.json")
            self.where = {}
            for p in paths:
                with _safe_open(p) as f:
                    self.where.update({n: p for n in f.keys()})
        self._open: dict = {}
        self.used: set = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def slice(self, name: str):
        if name not in self.where:
            raise ValueError(f"checkpoint {self.path}: tensor {name} is missing from "
                             f"{self.listing}: the weights are incomplete or config.json "
                             "describes another model; restore the checkpoint's files or "
                             "use the config.json they were saved with")
        p = self.where[name]
        if p not in self._open:
            self._open[p] = _safe_open(p)
        self.used.add(name)
        try:
            return self._open[p].get_slice(name)
        except SafetensorError:
            raise ValueError(f"{p}: holds no tensor {name}, which {self.listing} places "
                             "there; restore the checkpoint's index") from None

    def shape(self, name: str) -> tuple:
        return tuple(self.slice(name).get_shape())


def _rng(s: slice, n: int) -> range:
    return range(*s.indices(n))


def _sl(r: range) -> slice:
    return slice(r.start, r.stop)


def _read(ts, how: str, idx: tuple, shape: tuple, cfg: ModelConfig) -> np.ndarray:
    """The block `idx` (slices of our inner axes, whose sizes are `shape`) of our array,
    read from the HF tensor slice `ts` without reading rows outside it."""
    r = [_rng(s, n) for s, n in zip(idx, shape)]
    if how == "as_is":
        return ts[tuple(_sl(x) for x in r)]
    if how == "transposed":  # ours [..., i, j] = hf [..., j, i]
        block = ts[tuple(_sl(x) for x in r[:-2]) + (_sl(r[-1]), _sl(r[-2]))]
        return np.swapaxes(block, -1, -2)
    dh = cfg.head_dim
    if how == "in_heads":  # ours [D, H, Dh] from hf [H·Dh, D]
        rows = slice(r[1].start * dh, r[1].stop * dh)
        block = ts[rows, _sl(r[0])].reshape(len(r[1]), dh, len(r[0]))
        return block[:, _sl(r[2])].transpose(2, 0, 1)
    if how == "heads_in":  # ours [H, Dh, D] from hf [D, H·Dh]
        cols = slice(r[0].start * dh, r[0].stop * dh)
        block = ts[_sl(r[2]), cols].reshape(len(r[2]), len(r[0]), dh)
        return block[:, :, _sl(r[1])].transpose(1, 2, 0)
    # gate_half / up_half: ours [E, D, F] from rows [0, F) / [F, 2F) of hf [E, 2F, D]
    off = 0 if how == "gate_half" else cfg.expert_ffn_dim
    block = ts[_sl(r[0]), off + r[2].start:off + r[2].stop, _sl(r[1])]
    return block.transpose(0, 2, 1)


def _fused(ckpt: _Checkpoint) -> bool:
    """Which expert layout the checkpoint holds (its shapes are checked with the rest)."""
    return PREFIX.format(l=0) + "mlp.experts.gate_up_proj" in ckpt


def _sources(ckpt: _Checkpoint, cfg: ModelConfig) -> dict:
    """For each params leaf: (HF name template, how, stacked axes: 'l' / 'le' / '')."""
    src = {"embed": ("model.embed_tokens.weight", "as_is", ""),
           "final_norm": ("model.norm.weight", "as_is", "")}
    if not cfg.tie_embeddings:
        src["unembed"] = ("lm_head.weight", "transposed", "")
    layers = {k: (PREFIX + n, how, "l") for k, (n, how) in LAYER.items()}
    if _fused(ckpt):
        layers.update({k: (PREFIX + n, how, "l") for k, (n, how) in FUSED.items()})
    else:
        layers.update({k: (PREFIX + n, "transposed", "le") for k, n in PER_EXPERT.items()})
    return {**src, "layers": layers}


def _check_shapes(ckpt, sources, shapes, cfg) -> None:
    """Each HF tensor's shape must be what config.json implies (read from the header)."""
    def want(leaf, how, stacked):
        inner = leaf.shape[len(stacked):]
        if how == "transposed":
            return inner[:-2] + (inner[-1], inner[-2])
        if how == "in_heads":
            return (inner[1] * inner[2], inner[0])
        if how == "heads_in":
            return (inner[2], inner[0] * inner[1])
        if how in ("gate_half", "up_half"):
            return (inner[0], 2 * inner[2], inner[1])
        return inner

    for key, (tmpl, how, stacked), leaf in _flat(sources, shapes):
        for n in _names(tmpl, stacked, cfg):
            if ckpt.shape(n) != want(leaf, how, stacked):
                raise ValueError(f"checkpoint: {n} has shape {ckpt.shape(n)}, expected "
                                 f"{want(leaf, how, stacked)} for {key} "
                                 f"{tuple(leaf.shape)}; does config.json match the weights?")


def _names(tmpl: str, stacked: str, cfg: ModelConfig) -> list[str]:
    """The HF tensor names one of our leaves is read from, layer-major then expert."""
    return [tmpl.format(l=l, e=e) for l in range(cfg.num_layers if stacked else 1)
            for e in range(cfg.num_experts if stacked == "le" else 1)]


def _check_finite(params: dict, sources: dict, shapes: dict, ckpt, path: str) -> None:
    """Refuse NaN / inf anywhere in the loaded params, naming the HF tensor and file."""
    leaves, stacked, templates = {}, {}, {}
    flat_params = traverse_util.flatten_dict(params, sep=".")
    for key, (tmpl, _, st), _ in _flat(sources, shapes):
        leaves[key] = flat_params[key]
        stacked[key], templates[key] = len(st), tmpl
    names = []
    for key, blocks in hf_validate.nonfinite(leaves, stacked).items():
        for ix in blocks:  # (layer, expert) of a stacked leaf, () of an unstacked one
            l, e = (ix + (0, 0))[:2]
            names.append(templates[key].format(l=l, e=e))
    names = list(dict.fromkeys(names))  # w_gate and w_up share a fused gate_up_proj
    if names:
        more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
        raise ValueError(
            f"checkpoint {path}: tensor {names[0]} in {os.path.basename(ckpt.where[names[0]])}"
            f" holds NaN or inf{more}; the weights are damaged: re-download or re-export "
            "the checkpoint")


def _flat(sources: dict, shapes: dict):
    """(key, source, shape) of every parameter: keys `embed`, `layers.w_gate`, …"""
    flat_shapes = traverse_util.flatten_dict(shapes, sep=".")
    for k, v in traverse_util.flatten_dict(sources, sep=".").items():
        yield k, v, flat_shapes[k]


def read_config(path: str, **overrides) -> ModelConfig:
    """The ModelConfig of checkpoint directory `path` (`check_config_against_weights`);
    `overrides` replace fields (as in `hf_config.model_config_from_hf`)."""
    return ModelConfig(**{**check_config_against_weights(path), **overrides})


# Fields config.json defines that a run still chooses: the master weights' dtype
# (parameters and optimizer state; float32 by default whatever the checkpoint's dtype, so
# an lr-1e-6 update is not rounded away by bf16 weights). `--export-hf` writes the
# checkpoint's own dtype back (`checkpoint_dtype`).
RUN_CHOSEN = ("param_dtype",)


def _hf_json(path: str) -> dict:
    storage.check_local(path, "Hugging Face checkpoint")
    source = os.path.join(path, "config.json")
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{source}: no such file; a Hugging Face checkpoint "
                                "directory holds config.json beside its safetensors")
    return read_json(source)


def check_config_against_weights(path: str) -> dict:
    """config.json's architecture (`hf_config.checkpoint_fields`) checked against the
    weights in `path`: layer count against the tensor names (index weight_map, else the
    headers); vocab, hidden size, head width and counts, expert count and width against the
    header shapes of the embedding and layer 0 (`load_hf_params` checks every shape; a
    square weight stored transposed passes: docs/guides/interop.md has the check for it)."""
    source = os.path.join(path, "config.json")
    fields = hf_config.checkpoint_fields(_hf_json(path), source=source)
    ckpt = _Checkpoint(path)

    def dims(name: str, rank: int) -> tuple:
        shape = ckpt.shape(name)
        if len(shape) != rank:
            raise ValueError(f"checkpoint {path}: tensor {name} has shape {shape}, not "
                             f"{rank} dimension(s); restore the checkpoint's files")
        return shape

    def agree(field: str, ours, theirs, where: str) -> None:
        if ours != theirs:
            raise ValueError(f"{source}: {field} is {ours}, but the weights hold {theirs} "
                             f"({where}, in {ckpt.listing}); set {field} to {theirs}, or "
                             "use the config.json these weights were saved with")

    layers = {int(m.group(1)) for n in ckpt.where if (m := _LAYER_INDEX.match(n))}
    if not layers:
        raise ValueError(f"{ckpt.listing}: no model.layers.* tensors: these are not a "
                         "Qwen3-MoE model's weights; restore the checkpoint's files")
    agree("num_hidden_layers", fields["num_layers"], len(layers),
          f"tensors named model.layers.{{0..{len(layers) - 1}}}.*")
    vocab, hidden = dims("model.embed_tokens.weight", 2)
    agree("vocab_size", fields["vocab_size"], vocab, "rows of model.embed_tokens.weight")
    agree("hidden_size", fields["d_model"], hidden, "columns of model.embed_tokens.weight")
    l0 = PREFIX.format(l=0)
    (head_dim,) = dims(l0 + "self_attn.q_norm.weight", 1)
    agree("head_dim", fields["head_dim"], head_dim, f"the width of {l0}self_attn.q_norm")
    for field, key, proj in [("num_attention_heads", "num_heads", "q_proj"),
                             ("num_key_value_heads", "num_kv_heads", "k_proj")]:
        rows = dims(f"{l0}self_attn.{proj}.weight", 2)[0]
        agree(field, fields[key], rows / head_dim if rows % head_dim else rows // head_dim,
              f"{l0}self_attn.{proj} has {rows} rows of {head_dim}-wide heads")
    agree("num_experts", fields["num_experts"], dims(l0 + "mlp.gate.weight", 2)[0],
          f"rows of the router {l0}mlp.gate.weight")
    ffn = (dims(l0 + FUSED["w_gate"][0], 3)[1] // 2 if _fused(ckpt) else
           dims(l0 + PER_EXPERT["w_gate"].format(e=0), 2)[0])
    agree("moe_intermediate_size", fields["expert_ffn_dim"], ffn,
          f"the width of {l0}mlp.experts' gate_proj")
    return fields


def checkpoint_dtype(path: str) -> str:
    """The parameter dtype the checkpoint directory `path` stores (config.json)."""
    return hf_config.checkpoint_fields(_hf_json(path), source=os.path.join(
        path, "config.json"))["param_dtype"]


def experiment_with_checkpoint(cfg: ExperimentConfig, path: str) -> ExperimentConfig:
    """`cfg` with the architecture of checkpoint `path` (`check_config_against_weights`);
    how to compute (compute_dtype, remat, dispatch, unroll_layers, kv_cache_layout, …) and
    `RUN_CHOSEN` stay as cfg.model. task.tokenizer_dir = path if unset and it ships a
    tokenizer.json (else the task's SentencePiece, e.g. for a checkpoint exported here)."""
    arch = check_config_against_weights(path)
    model = cfg.model.replace(**{k: v for k, v in arch.items() if k not in RUN_CHOSEN})
    task = cfg.task
    if not task.tokenizer_dir and os.path.exists(os.path.join(path, "tokenizer.json")):
        task = task.replace(tokenizer_dir=path)
    return cfg.replace(model=model, task=task)


def load_hf_params(path: str, cfg: ModelConfig, shardings=None) -> dict:
    """The params at `path` in `cfg.param_dtype`, each on its `jax.sharding.Sharding` (e.g.
    `Engine.param_shardings`; default: the first device); a device reads only its block."""
    ckpt = _Checkpoint(path)
    shapes = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg))
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    sources = _sources(ckpt, cfg)
    _check_shapes(ckpt, sources, shapes, cfg)
    hf_validate.check_dtypes(ckpt, [n for _, (tmpl, _, st), _ in _flat(sources, shapes)
                                    for n in _names(tmpl, st, cfg)], path)
    dtype = dtype_of(cfg.param_dtype)

    def build(tmpl, how, stacked, leaf, sh):
        inner = leaf.shape[len(stacked):]

        def block(index):
            inner_idx = index[len(stacked):]
            if not stacked:
                return _read(ckpt.slice(tmpl), how, inner_idx, inner, cfg).astype(dtype)
            rows = []
            for l in _rng(index[0], cfg.num_layers):
                if stacked == "le":
                    rows.append(np.stack([
                        _read(ckpt.slice(tmpl.format(l=l, e=e)), how, inner_idx, inner, cfg)
                        for e in _rng(index[1], cfg.num_experts)]))
                else:
                    rows.append(_read(ckpt.slice(tmpl.format(l=l)), how, inner_idx, inner,
                                      cfg))
            return np.stack(rows).astype(dtype)

        return jax.make_array_from_callback(leaf.shape, sh, block)

    params = {}
    for key, (tmpl, how, stacked), leaf in _flat(sources, shapes):
        sh = shardings["layers"][key[7:]] if key.startswith("layers.") else shardings[key]
        arr = build(tmpl, how, stacked, leaf, sh)
        if key.startswith("layers."):
            params.setdefault("layers", {})[key[7:]] = arr
        else:
            params[key] = arr
    # A tied checkpoint may still hold lm_head (equal to the embedding): nothing to read.
    unused = sorted(n for n in ckpt.where if n not in ckpt.used
                    and not n.endswith(_IGNORED_SUFFIXES)
                    and not (cfg.tie_embeddings and n == "lm_head.weight"))
    if unused:
        raise ValueError(f"checkpoint: {len(unused)} tensor(s) this model has no place for, "
                         f"e.g. {unused[:3]}: biases, quantization scales or dense MLP layers "
                         "are not supported; convert the checkpoint to plain Qwen3-MoE "
                         "weights")
    _check_finite(params, sources, shapes, ckpt, path)
    return params


def load_qwen3_moe(path: str, *, mesh=None, **overrides) -> tuple[dict, ModelConfig]:
    """(params, ModelConfig) of Qwen3-MoE checkpoint directory `path`; `mesh` (from
    `sharding.make_mesh`; None: the first device) places parameters by `sharding.RULES` as
    `Engine.create` does; overrides replace config.json's fields (max_seq_len, …)."""
    cfg = read_config(path, **overrides)
    shardings = None
    if mesh is not None:
        shapes = jax.eval_shape(lambda: tf.init_params(jax.random.key(0), cfg))
        shardings = sharding.tree_shardings(tf.param_logical_axes(cfg), shapes, mesh)
    return load_hf_params(path, cfg, shardings), cfg
