"""The fused log-prob / entropy op's table: implementations, block sizes, example shapes.
No JAX (the config validates RLConfig.logprob_impl against `LOGPROB_IMPLS`).

Letters: T tokens, D model, V vocab, W vocab columns of one chunk.

Every implementation computes (logp_T, entropy_T) = fn(hidden_TxD, unembed_DxV,
targets_T[, block=][, interpret=]) (fused_logprob.py; `fused_logprob.fused_logprob(...,
impl=name)` runs a row). Each row of `LOGPROB_IMPLS` says what it is; the reference is
"naive".
"""
from __future__ import annotations

import dataclasses

from stablerl_jax.kernels import Arg, Impl, check_blocks


@dataclasses.dataclass(frozen=True)
class LogprobBlocks:
    """Tile sizes. `chunk`: the vocab chunk W of "chunked". The Pallas kernels': forward
    token block `tokens`, vocab tile `vocab`, `vocab_tiles` tiles streamed per program;
    backward `bwd_chunk` vocab columns per scan step, dz tile `bwd_tokens` × `bwd_vocab`;
    `dim`, the D slice both accumulate logits over (the matmul K loop; ≥ D: one dot); Triton
    launch knobs `num_warps`, `num_stages` (GPU only). Powers of two keep Triton happy; TPU
    wants multiples of 8 (tokens) and 128. Defaults: the fastest of a sweep on an H100 in
    bf16 at (T, D, V) = (8192, 512, 65536) (docs/records/benchmarks.md)."""

    chunk: int = 2048
    tokens: int = 128
    vocab: int = 256
    vocab_tiles: int = 4
    dim: int = 64
    bwd_chunk: int = 8192
    bwd_tokens: int = 128
    bwd_vocab: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        check_blocks(self)


# Blocks for Mosaic (TPU): token blocks multiples of 8, vocab tiles multiples of 128
# lanes, and one dot over all of D (a D slice narrower than 128 lanes is not a legal TPU
# block); two 512-column tiles per forward program keep the double-buffered [D, 1024]
# weight block at 8 MiB of VMEM for D = 2048 in bf16.
LOGPROB_TPU_BLOCKS = LogprobBlocks(chunk=2048, tokens=256, vocab=512, vocab_tiles=2,
                                   dim=1 << 30, bwd_chunk=8192, bwd_tokens=256, bwd_vocab=512)

@dataclasses.dataclass(frozen=True)
class LogprobImpl(Impl):
    """A row of LOGPROB_IMPLS. `invariant`: a token's (logp, entropy) depend on its row
    alone (fixed tiles in a fixed order), and `fn(hidden, unembed, None)` returns the row's
    log p [T, V], each target's entry its logp bit for bit; model/invariant.py then runs it
    in both engines, the sampler drawing from the [T, V] form, the trainer from the fused."""

    invariant: bool = False


_OP = "stablerl_jax.kernels.fused_logprob"
LOGPROB_IMPLS: dict[str, LogprobImpl] = {
    # The reference: full float32 logits, log_softmax, gather. O(T·V) memory.
    "naive": LogprobImpl(f"{_OP}:naive", ("cpu", "gpu", "tpu")),
    # Pure JAX, a scan over vocab chunks with a custom VJP. O(T·W) memory; the default.
    "chunked": LogprobImpl(f"{_OP}:chunked", ("cpu", "gpu", "tpu"), blocks=LogprobBlocks()),
    # The same custom VJP with the Pallas kernels (fused_logprob_pallas.py) compiled by
    # Triton / Mosaic. Batch-invariant: fixed [Bt, Bv] logit tiles, D and the vocabulary
    # in a fixed order, the target's logit taken from its tile.
    "pallas_gpu": LogprobImpl(f"{_OP}:pallas", ("gpu",), {"target": "gpu"}, LogprobBlocks(),
                              pallas=True, invariant=True),
    "pallas_tpu": LogprobImpl(f"{_OP}:pallas", ("tpu",), {"target": "tpu"},
                              LOGPROB_TPU_BLOCKS, pallas=True, invariant=True),
}


def logprob_example_args(tokens: int, d_model: int, vocab: int, dtype: str
                         ) -> tuple[tuple[Arg, ...], dict]:
    """(arguments, static keywords) for `tokens` tokens per device; the unembedding whole."""
    return (Arg("hidden_TxD", (tokens, d_model), dtype, True, True),
            Arg("unembed_DxV", (d_model, vocab), dtype, False, True),
            Arg("targets_T", (tokens,), "int32", True, False)), {}
