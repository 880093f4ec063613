"""tests/tiers.py's guard on its own lists: an entry naming no test (its file gone, or its
file collected without a test of that name) is reported, so a moved or renamed test
cannot drop out of its tier unnoticed."""
from types import SimpleNamespace

import tiers


def _items(root, *nodeids):
    session = SimpleNamespace(config=SimpleNamespace(rootpath=root))
    return [SimpleNamespace(nodeid=n, session=session) for n in nodeids]


def test_an_entry_naming_no_test_is_stale(tmp_path, monkeypatch):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "a_test.py").write_text("")
    monkeypatch.setattr(tiers, "SAMPLED", ("tests/a_test.py::test_p",))
    monkeypatch.setattr(tiers, "HEAVY", ("tests/a_test.py::test_h[1]",
                                         "tests/gone_test.py::test_g"))
    monkeypatch.setattr(tiers, "BEYOND_CI", ("tests/a_test.py::test_renamed",))
    items = _items(tmp_path, "tests/a_test.py::test_p[0]", "tests/a_test.py::test_p[1]",
                   "tests/a_test.py::test_h[1]")
    assert tiers.stale_entries(items) == ["tests/a_test.py::test_renamed",
                                          "tests/gone_test.py::test_g"]
    # A run of another file says nothing of a_test.py's entries (it was not collected).
    (tmp_path / "tests" / "b_test.py").write_text("")
    assert tiers.stale_entries(_items(tmp_path, "tests/b_test.py::test_b")) == [
        "tests/gone_test.py::test_g"]

