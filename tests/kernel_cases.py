"""Which rows of a kernel table (kernels/*_impls.py) the kernel tests run on this backend,
and how: those compiled for it, and on a CPU the Pallas kernels in the checking
interpreter. The tests' parametrizations read the tables through `impl_params`, so a new
row is tested without editing them."""
import jax
import pytest

BACKEND = jax.default_backend()
# The tests choose how Pallas runs: interpreted on a CPU, compiled on an accelerator.
INTERPRET = BACKEND == "cpu"


def _runs_here(row) -> bool:
    return BACKEND in row.backends or (INTERPRET and row.pallas)


def impls_here(table) -> list[str]:
    """The names of the rows of `table` the tests run on this backend."""
    return [name for name, row in table.items() if _runs_here(row)]


def impl_params(table, where=lambda name, row: True) -> list:
    """Every row of `table` for which `where(name, row)` holds, as a pytest parameter (its name);
    a row this backend does not run (compiled only for other backends: a TPU row on a
    GPU host, which does not interpret Pallas) is a skip that says so, so the report
    shows what was left out."""
    return [name if _runs_here(row) else pytest.param(name, marks=pytest.mark.skip(
                reason=f"{name}: compiled for {row.backends}, not {BACKEND}"))
            for name, row in table.items() if where(name, row)]
