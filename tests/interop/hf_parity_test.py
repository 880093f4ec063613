"""Parity with Hugging Face transformers' Qwen3MoeForCausalLM (marker `interop`: needs
the `interop` extra, torch and transformers, which .ci/run installs).

A tiny random HF model is built locally (nothing is downloaded), saved with
`save_pretrained`, loaded with our loader, and both run the same left-padded batch in
float32: the logits agree to the float32 rounding bound of the forward, and every real
token is routed to the same top-k experts in every layer. Our saver's output, in both
expert layouts, loads back into transformers and gives its logits bit for bit.
"""
import numpy as np
import pytest
from tolerance import LAMBDA, assert_close, forward_chain

torch = pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the interop extra (transformers) is not installed")

import jax.numpy as jnp  # noqa: E402

from stablerl_jax.interop import hf_checkpoint as hc  # noqa: E402
from stablerl_jax.interop.hf_export import save_qwen3_moe  # noqa: E402
from stablerl_jax.model import transformer as tf  # noqa: E402

pytestmark = pytest.mark.interop
B, T = 3, 12


def _hf_model(path, *, layers, norm_topk_prob, tied):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        tie_word_embeddings=tied, max_position_embeddings=64, rope_theta=10_000.0,
        rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    # Spread the router's logits so that no two experts are within rounding of a tie.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
    model.save_pretrained(path)
    return model


def _batch():
    tokens = np.random.default_rng(0).integers(0, 1000, (B, T))
    mask = np.ones((B, T), bool)
    mask[1, :4] = False  # left padding, as the trainer's batches have
    mask[2, :7] = False
    return tokens, mask


def _hf_forward(model, tokens, mask):
    """Logits [B, T, V] and the top-k experts [B, T, L, K] of an HF model. Positions are
    counted over real tokens, as ours are (HF's default would count the padding)."""
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(
            np.int64)), position_ids=torch.tensor(pos), output_router_logits=True)
    k = model.config.num_experts_per_tok
    routes = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy().reshape(B, T, k)
                       for r in out.router_logits], axis=2)
    return out.logits.numpy(), routes


@pytest.mark.parametrize("layers,norm_topk_prob,tied", [(3, True, False), (2, False, True)])
def test_logits_and_experts_match_transformers(tmp_path, layers, norm_topk_prob, tied):
    model = _hf_model(str(tmp_path), layers=layers, norm_topk_prob=norm_topk_prob, tied=tied)
    params, cfg = hc.load_qwen3_moe(str(tmp_path))
    assert (cfg.num_layers, cfg.norm_topk_prob, cfg.tie_embeddings) == (
        layers, norm_topk_prob, tied)
    tokens, mask = _batch()
    ref_logits, ref_routes = _hf_forward(model, tokens, mask)
    hidden, aux = tf.forward(params, jnp.asarray(tokens), cfg,
                             attention_mask_BxT=jnp.asarray(mask))
    logits = np.asarray(tf.logits(params, hidden, cfg))
    # Padding slots are unused by both (and computed differently); compare real tokens.
    # n: the forward's longest rounding chain over T slots (tolerance.forward_chain) plus
    # the logit dot over D (1,128 / 1,628 roundings), in the probabilistic bound (λ = 6)
    # for chains this long; norm-wise (scale "max"): small logits carry large relative
    # rounding. Both sides are float32 evaluations of the same function. With
    # max |logit| ≈ 1 the bound is ≈ 2e-5, inside the 1e-4.
    assert_close(logits[mask], ref_logits[mask], n=forward_chain(cfg, T) + cfg.d_model,
                 lam=LAMBDA, scale="max")
    routes = np.asarray(aux["routes"])
    np.testing.assert_array_equal(np.sort(routes, -1)[mask], np.sort(ref_routes, -1)[mask])
    print(f"parity L={layers} norm_topk_prob={norm_topk_prob} tied={tied}: max |Δlogit| "
          f"{np.abs(logits - ref_logits)[mask].max():.3g} (max |logit| "
          f"{np.abs(ref_logits[mask]).max():.3g}); top-k experts equal on "
          f"{int(mask.sum())} tokens × {layers} layers")


@pytest.mark.parametrize("experts", ["per_expert", "fused"])
def test_our_saved_checkpoint_loads_in_transformers(tmp_path, experts):
    model = _hf_model(str(tmp_path / "hf"), layers=2, norm_topk_prob=True, tied=False)
    params, cfg = hc.load_qwen3_moe(str(tmp_path / "hf"))
    save_qwen3_moe(params, cfg, str(tmp_path / "ours"), experts=experts)
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32).eval()
    tokens, mask = _batch()
    a, ra = _hf_forward(model, tokens, mask)
    b, rb = _hf_forward(again, tokens, mask)
    # The same weights through the same code: identical.
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ra, rb)
