"""The surrogate losses' table: one row per loss naming its function, default aggregation and the
`LossConfig` knobs it reads. JAX-free: the config validates `LossConfig.name`, the knobs and
`row_denominator` against `LOSS_TABLE` on import; `losses.LOSSES` is the table, loaded.

Every function is (loss, metrics) = fn(logp_BxT, batch: LossBatch, cfg: LossConfig) (losses.py)
and reads `SHARED_KNOBS`; a row's `knobs` are the others it reads. A knob some row lists
(`loss_knobs`) set off its default is refused for a loss whose row does not list it: it would
change nothing. `advantage` and `advantage_std_ddof` belong to the advantages (advantages.py);
`center` and `center_k` to score centering, applied around any loss (method/centering.py)."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

# losses.aggregate's modes. Every one but token_mean is a mean over rows, whose row
# count LossConfig.row_denominator picks (losses.py).
AGGREGATIONS = ("response_sum", "seq_mean_token_mean", "token_mean",
                "seq_mean_token_sum_norm")
SHARED_KNOBS = ("clip", "use_is", "is_correction", "tis_cap", "is_low", "is_high",
                "max_log_ratio", "aggregation", "norm_length", "row_denominator",
                "trust_region", "trust_region_delta")


@dataclasses.dataclass(frozen=True)
class LossRow:
    """One loss: a row of `LOSS_TABLE`. fn: "module:attribute" of the loss function, imported on
    first use; aggregation: one of AGGREGATIONS, used when LossConfig.aggregation is None; knobs:
    the LossConfig fields beyond SHARED_KNOBS that the loss reads."""

    fn: str
    aggregation: str
    knobs: tuple[str, ...] = ()

    def __post_init__(self):
        if self.fn.count(":") != 1:
            raise ValueError(f"LossRow.fn={self.fn!r} must be 'module:attribute'")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"LossRow.aggregation={self.aggregation!r} must be one of "
                             f"{AGGREGATIONS}")
        if shared := set(self.knobs) & set(SHARED_KNOBS):
            raise ValueError(f"LossRow.knobs={self.knobs!r}: {sorted(shared)} are read by "
                             "every loss (SHARED_KNOBS), not listed per row")

    def load(self) -> Callable:
        """The loss function."""
        module, attr = self.fn.split(":")
        # Not a bare getattr: losses.py loads its rows while it is being imported, and
        # Python would blame a missing name on a circular import.
        fn = getattr(importlib.import_module(module), attr, None)
        if fn is None:
            raise AttributeError(f"LossRow.fn={self.fn!r}: {module} defines no {attr!r}")
        return fn


_MOD = "stablerl_jax.method.losses"
_PPO = ("eps_low", "eps_high")  # the clip range on the staleness ratio r = π_θ/π_old
_GSPO = ("gspo_eps_low", "gspo_eps_high", "gspo_max_log_ratio")
LOSS_TABLE: dict[str, LossRow] = {
    "minirl": LossRow(f"{_MOD}:minirl", "response_sum", _PPO + ("cap_target",)),
    "grpo": LossRow(f"{_MOD}:grpo", "seq_mean_token_mean", _PPO + ("clip_ratio_c",)),
    "cispo": LossRow(f"{_MOD}:cispo", "token_mean", _PPO),
    "gspo": LossRow(f"{_MOD}:gspo", "seq_mean_token_mean", _GSPO),
    "gspo_token": LossRow(f"{_MOD}:gspo_token", "seq_mean_token_mean", _GSPO),
    "dapo": LossRow(f"{_MOD}:dapo", "token_mean", _PPO + ("clip_ratio_c",)),
}


def loss_knobs(table: dict[str, LossRow]) -> tuple[str, ...]:
    """The knobs listed by any row of `table`, each once, in order of first listing."""
    return tuple(dict.fromkeys(k for row in table.values() for k in row.knobs))


def readers(table: dict[str, LossRow], knob: str) -> tuple[str, ...]:
    """The losses of `table` whose row lists `knob`."""
    return tuple(name for name, row in table.items() if knob in row.knobs)
