"""Which rows of a kernel table (kernels/*_impls.py) the kernel tests run on this backend,
and how: those compiled for it, and on a CPU the Pallas kernels in the checking
interpreter. The tests' parametrizations read the tables through `impls_here`, so a new
row is tested without editing them."""
import jax

BACKEND = jax.default_backend()
# The tests choose how Pallas runs: interpreted on a CPU, compiled on an accelerator.
INTERPRET = BACKEND == "cpu"


def impls_here(table) -> list[str]:
    """The names of the rows of `table` the tests run on this backend."""
    return [name for name, row in table.items()
            if BACKEND in row.backends or (INTERPRET and row.pallas)]

