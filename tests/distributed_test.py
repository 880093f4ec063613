"""distributed.gather's one buffer: every leaf of every process comes back whole (the
collective itself runs across processes in tests/multihost_test.py)."""
import numpy as np

from stablerl_jax import distributed


def test_the_packed_leaves_of_two_processes_unpack_to_their_concatenation():
    # Mixed dtypes and sizes, so leaves start at offsets their dtype does not divide.
    procs = [[np.array([p, 1 - p], bool), np.arange(3, dtype=np.float64) + 10 * p,
              np.full((2, 3), p, np.int32), np.float32(p + 0.5)] for p in (0, 1)]
    buffer_nxb = np.stack([distributed.pack_bytes(leaves) for leaves in procs])
    got = distributed.unpack_bytes(buffer_nxb, procs[0])
    for i, (a, b) in enumerate(zip(*procs)):
        want = np.stack([a, b]) if np.ndim(a) == 0 else np.concatenate([a, b])
        assert got[i].dtype == want.dtype
        np.testing.assert_array_equal(got[i], want)


def test_one_process_gets_its_own_rows():
    tree = {"a": np.arange(4), "b": (np.ones(2, bool),)}
    got = distributed.gather(tree)
    np.testing.assert_array_equal(got["a"], tree["a"])
    np.testing.assert_array_equal(got["b"][0], tree["b"][0])
