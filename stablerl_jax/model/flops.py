"""Model FLOPs: the matmul FLOPs a forward pass needs, as MFU numerators count them.

Letters: D model, H heads, KV kv heads, Dh head width, E experts, K top-k, F expert FFN
width, V vocab, L layers, S sequence length.

Per token and layer, a forward multiplies: the q, o (D·H·Dh each) and k, v (D·KV·Dh each)
projections, QKᵀ and PV against the causal half of the keys (2·H·Dh·S/2), the router
(D·E) and the K active SwiGLU experts (3·D·F each); per token once, the unembedding
(D·V). 2 FLOPs per multiply-add. Element-wise work, masked-out attention entries that a
kernel computes anyway and tile padding are not model FLOPs.
"""
from __future__ import annotations

from stablerl_jax.config import ModelConfig


def forward_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Matmul FLOPs of one forward pass over batch × seq tokens."""
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_token_layer = 2 * (d * h * hd * 2 + d * kv * hd * 2)      # q, o and k, v projections
    per_token_layer += 2 * 2 * h * hd * seq / 2                     # QKᵀ and PV, causal half
    per_token_layer += 2 * d * cfg.num_experts                      # router
    per_token_layer += 2 * cfg.top_k * 3 * d * cfg.expert_ffn_dim   # active SwiGLU experts
    per_token = cfg.num_layers * per_token_layer + 2 * d * cfg.vocab_size
    return float(per_token * batch * seq)


def train_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """Forward + backward (the backward is two matmuls per forward matmul: 3× forward)."""
    return 3.0 * forward_flops(cfg, batch, seq)
