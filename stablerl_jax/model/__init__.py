"""The Qwen3-MoE style decoder as pure functions over a params pytree.

    transformer.py     init, `forward` (training) and the decode step (sampling)
    attention.py       RMSNorm, RoPE, grouped-query attention with q/k norms, KV cache
    moe.py             routing with optional replay (R2 / R3) and the SwiGLU experts
    expert_parallel.py the expert FFN on a mesh (`shard_map`, all-to-all dispatch)
    invariant.py       batch-invariant numerics (`sampling.numerics=bitwise`): fixed tiles
    invariant_layer.py the per-token decoder layer, per device on a mesh
    layer_inputs.py    the two records a decoder layer reads (its tokens, its numerics)
    numerics.py        numerics policies: how one engine computes differently from another
    flops.py           model FLOPs per token, the numerator of MFU
"""
