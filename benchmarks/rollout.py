"""KV-cache decoding vs recomputing the whole sequence for every new token.

    python -m benchmarks.rollout [--new 256] [--batch 16] [--reps 3]

Model: 4 layers, D=256, E=8, K=2 (grouped dispatch). Both samplers produce the same
number of tokens with the same numerics; the no-cache one runs a full forward over the
prefix (static length, masked) at every step, as a sampler without a cache must.
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from stablerl_jax.config import ModelConfig, SamplingConfig
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import rollout as ro


@functools.partial(jax.jit, static_argnames=("cfg", "new"))
def sample_without_cache(params, prompts, key, cfg, new):
    """Greedy-free reference sampler: a full forward over the buffer for each token."""
    b, p = prompts.shape
    tokens = jnp.zeros((b, p + new), jnp.int32).at[:, :p].set(prompts)

    def body(i, tokens):
        mask = jnp.arange(p + new)[None, :] < p + i
        h, _ = tf.forward(params, tokens, cfg,
                          attention_mask_BxT=jnp.broadcast_to(mask, tokens.shape))
        z = tf.logits(params, jax.lax.dynamic_slice_in_dim(h, p + i - 1, 1, axis=1), cfg)[:, 0]
        tok = jax.random.categorical(jax.random.fold_in(key, i), z)
        return tokens.at[:, p + i].set(tok)

    return jax.lax.fori_loop(0, new, body, tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=512, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                      head_dim=32, num_experts=8, top_k=2, expert_ffn_dim=512,
                      max_seq_len=args.prompt + args.new, moe_tile=32)
    params = tf.init_params(jax.random.key(0), cfg)
    prompts = jax.random.randint(jax.random.key(1), (args.batch, args.prompt), 4, 512)
    mask = jnp.ones_like(prompts, bool)
    sampling = SamplingConfig(max_new_tokens=args.new)
    key = jax.random.key(2)
    # eos_id=-1: every row decodes all `new` tokens, like the baseline.
    cached = median_seconds(lambda: ro.sample(params, prompts, mask, key, cfg, sampling,
                                              nx.numerics_preset("exact"), eos_id=-1,
                                              pad_id=0).tokens_BxS, reps=args.reps)
    full = median_seconds(lambda: sample_without_cache(params, prompts, key, cfg, args.new),
                          reps=args.reps)
    n = args.batch * args.new
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, batch {args.batch}, "
          f"prompt {args.prompt}, new tokens {args.new}, median of {args.reps}")
    print("| sampler | seconds | tokens/s |")
    print("|---|---|---|")
    print(f"| KV cache (prefill + decode) | {cached:.2f} | {n / cached:.0f} |")
    print(f"| recompute full sequence per token | {full:.2f} | {n / full:.0f} |")
    print(f"\nspeed-up (cache / recompute tokens/s): {full / cached:.1f}x")


if __name__ == "__main__":
    main()
