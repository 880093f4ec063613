"""experiments.main_job_seeds: the main job's table over seeds, its goal, the runs it calls."""
import pytest

from experiments import main_job_seeds, train


def _summary(start, end, wall=200.0):
    return {"start_accuracy": start, "end_accuracy": end, "steps": 200, "wall_seconds": wall}


def test_the_table_gives_each_seeds_gain_and_the_paired_interval():
    # Gains 0.10, 0.12, 0.08: mean 0.10, sd 0.02, paired t interval 0.10 ± 4.303 · 0.02/√3.
    out = main_job_seeds.table({0: _summary(0.30, 0.40), 1: _summary(0.28, 0.40),
                                2: _summary(0.32, 0.40)})
    assert "| 1 | 0.280 | 0.400 | +0.120 | 200 |" in out
    assert "mean gain +0.100, seed-paired 95 % interval [+0.050, +0.150] over 3 seeds" in out
    assert out.endswith("met") and not out.endswith("not met")


@pytest.mark.parametrize("ends, why", [
    ((0.40, 0.40, 0.34), "a seed gains 0.02"),
    ((0.38, 0.38, 0.39), "every seed gains 0.06 or more, the mean 0.063"),
])
def test_the_goal_fails_on_a_small_gain(ends, why):
    out = main_job_seeds.table({s: _summary(0.32, e) for s, e in enumerate(ends)})
    assert out.endswith("not met"), why


def test_each_seed_is_the_main_job_with_its_own_seeds(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or _summary(0.3, 0.4))
    got = main_job_seeds.main(["--workdir", str(tmp_path), "--seeds", "0,1,2", "--quiet",
                               "rl.steps=5"])
    assert list(got) == [0, 1, 2]
    assert calls[1] == ["--workdir", str(tmp_path / "seed1"), "sft.seed=1", "rl.seed=1",
                        "rl.steps=5", "--quiet"]


@pytest.mark.parametrize("seeds", ["0,1", "0,0,1", "a,b,c"])
def test_too_few_or_bad_seeds_are_one_line(seeds, capsys):
    with pytest.raises(SystemExit) as e:
        main_job_seeds.main(["--seeds", seeds])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--seeds" in err[-1]
