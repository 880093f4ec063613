"""ExperimentConfig's checks: settings valid alone, not together; sizes past what a run can use.

Bitwise numerics (`sampling.numerics=bitwise`) promise μ = π_old bit for bit: a sampler computing
unlike the trainer, or an offline file's μ, is refused; only the dials
`sampling.router_noise_std` and `sampling.act_fp8` add a stated mismatch (docs/method.md §12)."""
from __future__ import annotations

from stablerl_jax.config.checks import check

DIALS = ("sampling.router_noise_std", "sampling.act_fp8")


def router_dtype(set_to: str, compute_dtype: str) -> str:
    """Router dtype: `set_to`, or '': compute dtype widened to float32 (model.router_dtype)."""
    return set_to or ("float64" if compute_dtype == "float64" else "float32")


def check_bitwise(cfg) -> None:
    """Under 'bitwise': both engines compute per token, the sampler's router computes as
    the trainer's, and μ is this sampler's (not an offline file's)."""
    s, m = cfg.sampling, cfg.model
    if s.numerics != "bitwise":
        return
    check(m.batch_invariant, "model.batch_invariant",
          "must be true under sampling.numerics='bitwise': both engines then compute every "
          "row per token (model/invariant.py); set model.batch_invariant=true (an override "
          "sampling.numerics=bitwise sets it)")
    trainer = router_dtype(m.router_dtype, m.compute_dtype)
    check(not s.router_dtype or s.router_dtype == trainer, "sampling.router_dtype",
          f"{s.router_dtype!r} under sampling.numerics='bitwise' makes the sampler's router "
          f"compute otherwise than the trainer's ({trainer}: model.router_dtype="
          f"{m.router_dtype!r}), so μ ≠ π_old; set sampling.router_dtype='' (or "
          f"{trainer!r}), or use sampling.numerics='exact' for a deliberate mismatch (the "
          f"dials under 'bitwise': {', '.join(DIALS)})")
    check(not cfg.rl.offline_rollouts, "sampling.numerics",
          "'bitwise' promises μ = π_old from this sampler, but rl.offline_rollouts="
          f"{cfg.rl.offline_rollouts!r} trains on the log μ its file recorded (another "
          "engine's); set sampling.numerics='exact' (the sampler then only evaluates) or "
          "rl.offline_rollouts=''")


def forward_tokens(cfg) -> int:
    """Most tokens a forward holds: the largest batch (step responses, eval_problems × eval_k,
    SFT batch, sampler slots, one row per device) × model.max_seq_len."""
    rl = cfg.rl
    dp = cfg.mesh[0] * cfg.mesh[1] * cfg.mesh[2]
    rows = max(rl.prompts_per_step * rl.group_size, rl.eval_problems * rl.eval_k,
               cfg.sft.batch_size, cfg.sampling.max_batch, dp)
    return rows * cfg.model.max_seq_len


def check_sizes(cfg) -> None:
    """model.row_tile, decode_block and moe_tile (× top_k) at most what a forward fills
    (`forward_tokens`, or the field's default if larger): past it a tile only pads, and one near
    int32 asks for terabytes (each expert's rows pad to a whole expert tile)."""
    m = cfg.model
    for field, per_token in (("row_tile", 1), ("decode_block", 1), ("moe_tile", m.top_k)):
        default = type(m).__dataclass_fields__[field].default
        v, bound = getattr(m, field), max(forward_tokens(cfg) * per_token, default)
        what = "batch × model.max_seq_len" + (" × model.top_k" if per_token > 1 else "")
        check(v <= bound, f"model.{field}",
              f"{v:,} is more than any forward of this run can fill ({bound:,}: its largest "
              f"{what}), and past that a tile only pads; set it to at most {bound:,}")
