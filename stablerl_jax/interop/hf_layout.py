"""The name map of a Hugging Face Qwen3-MoE checkpoint: the HF tensor(s) each of our
parameters is read from (hf_checkpoint.py) and written to (hf_export.py), and how.

Letters: L layers, V vocab, D model, H heads, KV kv heads, Dh head width, E experts, F
expert FFN width. HF `nn.Linear` weights are [out, in] (y = x Wᵀ), ours [in, out]; every
per-layer name has the prefix `model.layers.{l}.`:

    ours                 HF tensor(s)                                  how
    embed      V×D       model.embed_tokens.weight         V×D        as is
    unembed    D×V       lm_head.weight                    V×D        transposed (untied only)
    final_norm D         model.norm.weight                 D          as is
    attn_norm  L×D       input_layernorm.weight            D          stacked over l
    mlp_norm   L×D       post_attention_layernorm.weight   D          stacked over l
    wq         L×D×H×Dh  self_attn.q_proj.weight           (H·Dh)×D   transposed, split heads
    wk, wv     L×D×KV×Dh self_attn.{k,v}_proj.weight       (KV·Dh)×D  transposed, split heads
    wo         L×H×Dh×D  self_attn.o_proj.weight           D×(H·Dh)   transposed, split heads
    q_norm, k_norm L×Dh  self_attn.{q,k}_norm.weight       Dh         stacked over l
    router     L×D×E     mlp.gate.weight                   E×D        transposed
    w_gate     L×E×D×F   mlp.experts.{e}.gate_proj.weight  F×D        per expert, transposed
                         or mlp.experts.gate_up_proj       E×2F×D     rows [0, F), transposed
    w_up       L×E×D×F   mlp.experts.{e}.up_proj.weight    F×D        per expert, transposed
                         or mlp.experts.gate_up_proj       E×2F×D     rows [F, 2F), transposed
    w_down     L×E×F×D   mlp.experts.{e}.down_proj.weight  D×F        per expert, transposed
                         or mlp.experts.down_proj          E×D×F      transposed

Released Qwen3-MoE checkpoints hold the per-expert layout (transformers 5 writes it back);
the fused `gate_up_proj` / `down_proj`, transformers 5's in-memory layout, is in some
converted checkpoints. Both load; the saver writes either (`experts=`).
"""

PREFIX = "model.layers.{l}."  # of every per-layer name
# Per-layer leaves: (HF name, how ours is read from it; see hf_checkpoint._read).
LAYER = {
    "attn_norm": ("input_layernorm.weight", "as_is"),
    "mlp_norm": ("post_attention_layernorm.weight", "as_is"),
    "wq": ("self_attn.q_proj.weight", "in_heads"),
    "wk": ("self_attn.k_proj.weight", "in_heads"),
    "wv": ("self_attn.v_proj.weight", "in_heads"),
    "wo": ("self_attn.o_proj.weight", "heads_in"),
    "q_norm": ("self_attn.q_norm.weight", "as_is"),
    "k_norm": ("self_attn.k_norm.weight", "as_is"),
    "router": ("mlp.gate.weight", "transposed"),
}
PER_EXPERT = {"w_gate": "mlp.experts.{e}.gate_proj.weight",
              "w_up": "mlp.experts.{e}.up_proj.weight",
              "w_down": "mlp.experts.{e}.down_proj.weight"}
FUSED = {"w_gate": ("mlp.experts.gate_up_proj", "gate_half"),
         "w_up": ("mlp.experts.gate_up_proj", "up_half"),
         "w_down": ("mlp.experts.down_proj", "transposed")}
