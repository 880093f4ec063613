"""Model FLOPs: the matmul FLOPs of a forward pass, as MFU numerators count them.

Per token and each of L layers (D model, H heads, KV kv heads, Dh head width, E experts, K top-k,
F expert FFN width, S sequence length): q, o (D·H·Dh each) and k, v (D·KV·Dh each) projections,
QKᵀ and PV over the causal half of the keys (2·H·Dh·S/2), router (D·E), K active SwiGLU experts
(3·D·F each); once per token, the unembedding (D·V, V vocab). 2 FLOPs per multiply-add;
element-wise work, masked attention entries a kernel computes anyway and tile padding do not
count.
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
