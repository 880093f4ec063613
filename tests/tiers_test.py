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
    monkeypatch.setattr(tiers, "LINES_RUN_ELSEWHERE", ("tests/a_test.py::test_p[1]",
                                                       "tests/a_test.py::test_p[2]"))
    monkeypatch.setattr(tiers, "SAMPLED_IN_INTEGRATION", {"tests/a_test.py::test_p": ("0",)})
    items = _items(tmp_path, "tests/a_test.py::test_p[0]", "tests/a_test.py::test_p[1]",
                   "tests/a_test.py::test_h[1]")
    assert tiers.stale_entries(items) == ["tests/a_test.py::test_p[2]",
                                          "tests/a_test.py::test_renamed",
                                          "tests/gone_test.py::test_g"]
    # A run of another file says nothing of a_test.py's entries (it was not collected).
    (tmp_path / "tests" / "b_test.py").write_text("")
    assert tiers.stale_entries(_items(tmp_path, "tests/b_test.py::test_b")) == [
        "tests/gone_test.py::test_g"]



class _Item:
    """What mark_tiers reads and writes of a collected test."""

    def __init__(self, nodeid, *markers):
        self.nodeid, self.markers = nodeid, set(markers)

    def iter_markers(self):
        return [SimpleNamespace(name=m) for m in self.markers]

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, mark):
        self.markers.add(mark.name)


def test_ci_runs_the_kept_cases_of_an_integration_product(monkeypatch):
    for name in ("SAMPLED", "SAMPLED_IN_CI", "HEAVY", "BEYOND_CI", "LINES_RUN_ELSEWHERE"):
        monkeypatch.setattr(tiers, name, ())
    monkeypatch.setattr(tiers, "SAMPLED_IN_INTEGRATION", {"t.py::test_p": ("1", "3"),
                                                          "t.py::test_w": ()})
    product = [_Item(f"t.py::test_p[{i}]", "integration") for i in range(4)]
    whole, other = _Item("t.py::test_w", "integration"), _Item("t.py::test_o", "integration")
    tiers.mark_tiers([*product, whole, other])
    assert [i.nodeid for i in product if "slow" not in i.markers] == [
        "t.py::test_p[1]", "t.py::test_p[3]"]
    assert all({"slow", "sampled"} <= i.markers for i in product if i.nodeid[-2] in "02")
    assert {"slow", "sampled"} <= whole.markers and "slow" not in other.markers


def test_a_test_whose_lines_others_run_leaves_ci_alone(monkeypatch):
    for name in ("SAMPLED", "SAMPLED_IN_CI", "HEAVY", "BEYOND_CI"):
        monkeypatch.setattr(tiers, name, ())
    monkeypatch.setattr(tiers, "SAMPLED_IN_INTEGRATION", {})
    monkeypatch.setattr(tiers, "LINES_RUN_ELSEWHERE", ("t.py::test_p[1]", "t.py::test_w"))
    product = [_Item(f"t.py::test_p[{i}]", "integration") for i in range(3)]
    whole, other = _Item("t.py::test_w", "integration"), _Item("t.py::test_o", "integration")
    tiers.mark_tiers([*product, whole, other])
    assert [i.nodeid for i in product if "slow" in i.markers] == ["t.py::test_p[1]"]
    assert "slow" in whole.markers and "slow" not in other.markers
    assert not any("sampled" in i.markers for i in [*product, whole])
