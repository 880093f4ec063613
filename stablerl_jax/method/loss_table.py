"""The old name of `stablerl_jax.config.loss_table`, the losses' table (the config
validates loss names against it, so it lives with the config). Kept for old imports."""
import warnings

from stablerl_jax.config.loss_table import (  # noqa: F401  (re-exported)
    AGGREGATIONS,
    LOSS_TABLE,
    SHARED_KNOBS,
    LossRow,
    loss_knobs,
    readers,
)

warnings.warn("stablerl_jax.method.loss_table is now stablerl_jax.config.loss_table; "
              "import it from there", DeprecationWarning, stacklevel=2)
