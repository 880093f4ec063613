"""Which rows of a kernel table (kernels/*_impls.py) the kernel tests run on this backend,
and how: those compiled for it, and on a CPU the Pallas kernels in the checking
interpreter. The tests' parametrizations read the tables through `impls_here`, so a new
row is tested without editing them."""
import warnings

import jax

BACKEND = jax.default_backend()
# The tests choose how Pallas runs: interpreted on a CPU, compiled on an accelerator.
INTERPRET = BACKEND == "cpu"


def impls_here(table) -> list[str]:
    """The names of the rows of `table` the tests run on this backend. A row compiled only
    for other backends (a TPU row on a GPU host, which does not interpret Pallas) is not
    run here, and said so in a warning, so the test report shows what was left out."""
    here = [name for name, row in table.items()
            if BACKEND in row.backends or (INTERPRET and row.pallas)]
    dropped = [name for name in table if name not in here]
    if dropped:
        warnings.warn(f"kernel tests on {BACKEND}: rows {dropped} not run (compiled for "
                      "other backends; a CPU host interprets them)", stacklevel=2)
    return here

