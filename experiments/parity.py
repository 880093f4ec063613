"""Logit parity of a Hugging Face Qwen3-MoE checkpoint with transformers, as one command:

    python -m experiments.parity DIR [--reference REF_DIR] [--tol TOL]

loads DIR with this project (`hf_checkpoint.load_qwen3_moe`) and REF_DIR (default: DIR)
with transformers' `AutoModelForCausalLM`, both in float32, runs a few prompts through
both, and prints max |Δlogit| of each beside its float32 bound. Exit status 0 when every
prompt is within its bound; 1, with one line on stderr, when one is not; 2 when a
checkpoint cannot be read. Needs the `interop` extra (torch, transformers) and the memory
of two float32 copies of the model.

What it catches. A square weight read transposed (q_proj and o_proj when
heads·head_dim = hidden_size; an expert's matrices when moe_intermediate_size =
hidden_size) passes every shape check. With DIR alone the command compares the two
loaders: a tensor this project reads in another layout than transformers does fails it.
A tensor transposed in the file itself is read the same wrong way by both, so it passes;
it is caught against the checkpoint the file was converted or exported from:
`--reference ORIGINAL_DIR`.

Prompts: three questions, rendered by DIR's chat template (data/chat_template.py) and
encoded by its tokenizer.json (data/hf_tokenizer.py), as a run renders them; without a
template, the plain question; without a tokenizer, seeded random ids. Experts: each
prompt first runs with each side's own routing; where a token's top-k experts differ in
some layer (a router near-tie broken the other way by rounding), ours runs again with
transformers' experts replayed, so the comparison is of the weights, not of tie-breaks;
the count of such (token, layer) pairs is printed.

The bound. Both sides evaluate one float32 function in different orders. Over T tokens
the longest chain of roundings is

    n = L·(5·D + 2·Dh + 2 + 2·T + H·Dh + E + F + K + 16) + 2·D

(per layer: the two RMSNorms and the q/k/v, router and gate/up dots over D, the q/k norms
and score dots over Dh, RoPE, softmax and weighted sum over T keys, the output projection
over H·Dh, the router softmax over E, the down projection over F, the combine over K and
about 16 elementwise ops; then the final RMSNorm and the logit dot over D). Rounding errors
behave as independent zero-mean variables, so the probabilistic bound of Higham & Mary
(SIAM J. Sci. Comput. 41(5), 2019, Thm. 2.4) applies: γ̃_n = exp(λ·√n·u + n·u²/(1 − u))
− 1 with u = 2⁻²⁴ and λ = 6 (failure probability 3e-8 per value), and two evaluations
differ by at most

    tol = 2·γ̃_n·max|logit|

per prompt, norm-wise (small logits carry large relative rounding). For a 2-layer model
of width 64 over 20 tokens, n ≈ 1,200 and tol ≈ 2.4e-5·max|logit|; a transposed square
projection moves logits by a sizeable fraction of max|logit|. `--tol` replaces the
bound with an absolute tolerance.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from stablerl_jax.interop import hf_checkpoint
from stablerl_jax.model import transformer as tf

QUESTIONS = ("What is 12 + 7?", "Find the value of x if 2x + 3 = 11.",
             "Please reason step by step, and put your final answer within \\boxed{}: 3 * 4")
LAMBDA = 6.0  # the bound's confidence parameter (module docstring)
U_FLOAT32 = 2.0**-24


def roundings(cfg, tokens: int) -> int:
    """n, the longest chain of float32 roundings to a logit (module docstring)."""
    d, dh, h = cfg.d_model, cfg.head_dim, cfg.num_heads
    per_layer = (5 * d + 2 * dh + 2 + 2 * tokens + h * dh + cfg.num_experts
                 + cfg.expert_ffn_dim + cfg.top_k + 16)
    return cfg.num_layers * per_layer + 2 * d


def bound(cfg, tokens: int, max_abs_logit: float) -> float:
    """tol = 2·γ̃_n·max|logit| (module docstring)."""
    n, u = roundings(cfg, tokens), U_FLOAT32
    return 2 * math.expm1(LAMBDA * math.sqrt(n) * u + n * u * u / (1 - u)) * max_abs_logit


def prompt_ids(path: str, cfg) -> list[np.ndarray]:
    """The token ids of QUESTIONS as a run would feed them (module docstring)."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        rng = np.random.default_rng(0)
        return [rng.integers(0, cfg.vocab_size, 16) for _ in QUESTIONS]
    from stablerl_jax.data.chat_template import ChatTemplate, ChatTemplateError
    from stablerl_jax.data.hf_tokenizer import HFTokenizer
    tok = HFTokenizer.from_dir(path)
    try:
        template = ChatTemplate.from_dir(path)
        texts = [template.render([{"role": "user", "content": q}]) for q in QUESTIONS]
    except ChatTemplateError:
        texts = list(QUESTIONS)
    ids = [np.asarray(tok.encode(t)[:cfg.max_seq_len]) for t in texts]
    if max(int(i.max()) for i in ids) >= cfg.vocab_size:
        raise ValueError(f"{path}: tokenizer.json has ids beyond vocab_size="
                         f"{cfg.vocab_size}; use the checkpoint's own tokenizer")
    return ids


def _hf_forward(model, ids: np.ndarray):
    """transformers' logits [T, V] and top-k experts [T, L, K] of one prompt."""
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids[None]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    routes = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy().reshape(len(ids), k)
                       for r in out.router_logits], axis=1)
    return out.logits[0].float().numpy(), routes


def _our_forward(params, ids_BxT, replay_BxTxLxK, cfg):
    hidden, aux = tf.forward(params, ids_BxT, cfg, replay_BxTxLxK=replay_BxTxLxK)
    return tf.logits(params, hidden, cfg), aux["routes"]


_our_forward_jit = jax.jit(_our_forward, static_argnames="cfg")


def compare(path: str, reference: str = "", tol: float | None = None) -> list[dict]:
    """Per prompt: tokens, max |Δlogit|, its bound (`tol` if given), max |logit| and the
    (token, layer) pairs whose experts differed (then replayed); module docstring."""
    import torch
    import transformers
    params, cfg = hf_checkpoint.load_qwen3_moe(path, param_dtype="float32",
                                               compute_dtype="float32")
    transformers.utils.logging.disable_progress_bar()  # stderr is for the verdict
    model = transformers.AutoModelForCausalLM.from_pretrained(
        reference or path, dtype=torch.float32).eval()
    rows = []
    for ids in prompt_ids(path, cfg):
        ref, ref_routes = _hf_forward(model, ids)
        tokens = jnp.asarray(ids[None], jnp.int32)
        logits, routes = _our_forward_jit(params, tokens, None, cfg=cfg)
        differ = int(np.sum(np.any(np.sort(np.asarray(routes[0]), -1)
                                   != np.sort(ref_routes, -1), -1)))
        if differ:
            logits, _ = _our_forward_jit(params, tokens, jnp.asarray(ref_routes[None],
                                                                     jnp.int32), cfg=cfg)
        scale = float(np.max(np.abs(ref)))
        rows.append({"tokens": len(ids), "max_abs_logit": scale,
                     "delta": float(np.max(np.abs(np.asarray(logits[0]) - ref))),
                     "bound": bound(cfg, len(ids), scale) if tol is None else tol,
                     "routes_differ": differ})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.parity",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the checkpoint this project loads")
    ap.add_argument("--reference", default="", help="the checkpoint transformers loads "
                    "(default: DIR); the original DIR was converted or exported from")
    ap.add_argument("--tol", type=float, default=None,
                    help="absolute tolerance on |Δlogit| (default: the float32 bound)")
    args = ap.parse_args(argv)
    prog = "parity"
    try:
        rows = compare(args.dir, args.reference, args.tol)
    except ImportError as e:
        print(f"{prog}: error: {e}; install the interop extra (torch, transformers)",
              file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    ref = args.reference or args.dir
    for i, r in enumerate(rows):
        replayed = (f"; {r['routes_differ']} (token, layer) pairs chose other experts, "
                    "compared with transformers' replayed" if r["routes_differ"] else "")
        print(f"prompt {i}: {r['tokens']} tokens, max |Δlogit| {r['delta']:.3g}, bound "
              f"{r['bound']:.3g} (max |logit| {r['max_abs_logit']:.3g}){replayed}")
    bad = [i for i, r in enumerate(rows) if not r["delta"] <= r["bound"]]
    if bad:
        r = rows[bad[0]]
        what = ("this project and transformers read a weight of it differently"
                if ref == args.dir else f"its weights are not {ref}'s (e.g. a square "
                "weight stored transposed)")
        print(f"{prog}: FAILED: {args.dir} vs transformers on {ref}: prompt {bad[0]} max "
              f"|Δlogit| {r['delta']:.3g} > bound {r['bound']:.3g} ({len(bad)} of "
              f"{len(rows)} prompts outside): {what}", file=sys.stderr)
        return 1
    print(f"parity OK: {args.dir} vs transformers on {ref}: every prompt within its "
          "float32 bound")
    return 0


if __name__ == "__main__":
    sys.exit(main())
