"""experiments/stabilizers.py: four mismatch cells × five arms, each arm the same override
at every cell, the seed-paired comparisons each cell's question needs, and one figure per
cell. (Its run: experiments_test.py's smoke case.)"""
from experiments import stabilizers
from stablerl_jax.config import apply_overrides


def test_every_cell_runs_every_arm_and_the_settings_resolve():
    exp = stabilizers.experiment()
    names = [v.name for v in exp.variants]
    assert len(names) == 20 and exp.seeds == (0, 1, 2, 3)
    cfgs = {v.name: exp.config(v, 0) for v in exp.variants}
    base = exp.base
    assert (base.rl.num_minibatches, base.rl.optim.learning_rate) == (8, 3e-4)
    assert base.rl.drift_monitor and base.model.compute_dtype == "bfloat16"
    for cell in ("bitwise", "exact", "fp8", "fp8-S2"):
        c = {arm: cfgs[f"{cell}-{arm}"] for arm, _ in stabilizers.ARMS}
        assert len({x.sampling for x in c.values()}) == 1  # the cell is the sampler
        assert c["center"].loss.center == c["R3+center"].loss.center == "exact"
        assert c["R3"].rl.replay == c["R3+center"].rl.replay == "r3"
        assert c["trust-region"].loss.trust_region == "k1"
        assert c["minirl"].loss == apply_overrides(base, []).loss
    assert cfgs["fp8-S2-minirl"].rl.max_staleness == 2
    assert cfgs["bitwise-minirl"].sampling.numerics == "bitwise"


def test_comparisons_and_figures_are_per_cell():
    names = [v.name for v in stabilizers.experiment().variants]
    pairs = stabilizers.comparisons(names)
    assert ("fp8-center", "fp8-minirl") in pairs and ("fp8-S2-R3+center", "fp8-S2-R3") in pairs
    cell_of = lambda n: max((c for c, _ in stabilizers.cells(0) if n.startswith(c + "-")),
                            key=len)
    assert len(pairs) == 4 * 6 and all(cell_of(a) == cell_of(b) for a, b in pairs)
    groups = stabilizers.figure_groups(names)
    assert list(groups) == ["bitwise", "exact", "fp8", "fp8-S2"]
    assert all(len(g) == 5 for g in groups.values())
    assert "fp8-S2-minirl" not in groups["fp8"]
