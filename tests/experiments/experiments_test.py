"""Experiment modules: the list of them, a couple of real steps of each tiny preset (smoke),
every preset's settings, and the seed-averaging / summary helpers."""
import importlib
import inspect
import json
import sys

import numpy as np
import pytest
from tolerance import bound

import experiments
from experiments import (
    cli,
    length_stats,
    mismatch_sweep,
    offpolicy,
    onpolicy,
    report,
    stats,
)
from experiments.runner import Experiment, Variant

# Every experiment module, found in the package: the tests below run over this.
ALL = experiments.descriptors()

# Few steps, short SFT: the modules' code paths, not their results. 16 eval problems × 4
# = 64 rows, the size of every variant's rollout batch, so eval reuses the compiled sampler.
# A trim bucket wider than any context keeps every rollout at its full width: one score
# and one update program per run instead of one per width (trimming: tests/rl/step_fns_test.py).
FAST = ["rl.steps=2", "rl.eval_every=2", "rl.eval_problems=16", "rl.eval_k=4",
        "rl.checkpoint_every=2", "sft.steps=2", "task.num_train=64", "task.num_test=16",
        "rl.trim_bucket=4096"]
# The variant each smoke run trains (one that takes the module's own path: replay,
# staleness, its own cold start, FP8 activations) and the overrides that make its rollout
# batch 64 rows. An experiment not named here runs its tiny preset's first variant.
SMOKE = {
    "onpolicy": ("minirl+R3", ["rl.prompts_per_step=8"]),  # 8 prompts × 8 = 64 rows
    "offpolicy": ("N2-minirl+R2", []),
    "coldstart": ("sft-terse", []),
    "async_staleness": ("S1-minirl+R3", ["rl.prompts_per_step=8"]),
    "mismatch_sweep": ("s0.3+actfp8-minirl", ["rl.prompts_per_step=8"]),
    "zero_mismatch": ("bitwise-minirl+R3", ["rl.prompts_per_step=8"]),
    "routing_fixes": ("frozen-fp32-router", ["rl.prompts_per_step=8"]),
    "stabilizers": ("fp8-R3+center", ["rl.prompts_per_step=8"]),  # 8 mini-batches of 8
}
# The others' smoke runs take ~1.5 min each: `pytest -m slow` runs them.
SMOKE_IN_INTEGRATION = ("onpolicy",)


def _smoke_cases() -> list:
    cases = []
    for name, desc in ALL.items():
        only, extra = SMOKE.get(name) or (desc.presets["tiny"]().variants[0].name, [])
        marks = pytest.mark.integration if name in SMOKE_IN_INTEGRATION else pytest.mark.slow
        cases.append(pytest.param(desc, only, extra, id=name, marks=marks))
    return cases


def test_every_module_is_listed():
    """Each module of the package is an experiment (it describes itself in EXPERIMENT and
    runs as `python -m experiments.<name>`), another entry point, or shared code."""
    names = experiments.module_names()
    others, shared = set(experiments.OTHER_ENTRY_POINTS), set(experiments.SHARED)
    assert others | shared <= set(names)  # no stale name
    assert not others & shared and set(ALL) == set(names) - others - shared
    assert set(SMOKE) <= set(ALL) and set(SMOKE_IN_INTEGRATION) <= set(ALL)
    for name in [*ALL, *others]:
        module = importlib.import_module(f"experiments.{name}")
        assert callable(module.main), name
        assert 'if __name__ == "__main__":' in inspect.getsource(module), name
        if name in ALL:
            assert ALL[name].name == name and module.main == ALL[name].main
    for name in shared:
        assert 'if __name__ == "__main__":' not in inspect.getsource(
            importlib.import_module(f"experiments.{name}")), name


def test_a_module_of_no_kind_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "stray.py").write_text('"""Neither an experiment nor listed."""\n')
    monkeypatch.setattr(experiments, "__path__", [*experiments.__path__, str(tmp_path)])
    try:
        with pytest.raises(TypeError, match=r"experiments/stray.py: no EXPERIMENT = "):
            experiments.descriptors()
    finally:
        sys.modules.pop("experiments.stray", None)


def test_descriptor_refuses_what_the_command_line_cannot_run():
    presets = {"tiny": lambda: Experiment(onpolicy.tiny_base(), (Variant("a"),))}
    ok = dict(module="experiments.x", doc="X.", title="X", presets=presets)
    assert cli.Descriptor(**ok).name == "x"
    with pytest.raises(ValueError, match="pass module=__spec__.name"):
        cli.Descriptor(**{**ok, "module": "__main__"})  # a module's __name__ under -m
    with pytest.raises(ValueError, match="pass doc=__doc__"):
        cli.Descriptor(**{**ok, "doc": None})
    with pytest.raises(ValueError, match="no 'tiny'"):
        cli.Descriptor(**{**ok, "presets": {"paper": presets["tiny"]}})


@pytest.mark.parametrize("desc, only, extra", _smoke_cases())
def test_tiny_preset_smoke(tmp_path, desc, only, extra):
    runs = desc.main(["--workdir", str(tmp_path), "--seeds", "0", "--only", only, "--quiet",
                      "--compile-cache=", *FAST, *extra])
    assert list(runs) == [only] and len(runs[only]) == 1
    records = runs[only][0]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(records[-1][k]) for k in ("reward", "entropy", "kl/train_infer_k1"))
    assert list(tmp_path.glob("comparison*.png"))
    rows = json.loads((tmp_path / "summary.json").read_text())["variants"]
    assert rows[0]["variant"] == only and rows[0]["seeds"] == 1
    assert only in (tmp_path / "summary.md").read_text()
    # --report rebuilds the same summary from the stored metrics, running nothing.
    (tmp_path / "summary.md").unlink()
    again = desc.main(["--workdir", str(tmp_path), "--seeds", "0,1", "--only", only,
                       "--report", *FAST, *extra])
    assert again == runs  # seed 1 never ran: left out
    assert only in (tmp_path / "summary.md").read_text()


@pytest.mark.integration
def test_long_preset_smoke(tmp_path):
    """Two steps of the long on-policy preset: its context holds 376 new tokens, rollouts
    run past 150 of them, and the sequence log-ratio monitors are logged."""
    runs = onpolicy.main(["--preset", "long", "--workdir", str(tmp_path), "--seeds", "0",
                          "--only", "minirl", "--quiet", "--compile-cache=", *FAST,
                          "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_k=1"])
    base = onpolicy.EXPERIMENTS["long"]().base
    assert base.sampling.max_new_tokens == base.task.max_solution_len
    assert base.model.max_seq_len >= base.task.max_prompt_len + base.task.max_solution_len
    last = runs["minirl"][0][-1]
    assert last["response/length_max"] >= 150
    assert all(np.isfinite(last[k]) for k in
               ("reward", "kl/train_infer_k1", "seq/log_ratio", "seq/log_ratio_sq",
                "seq/beyond_cap"))
    assert last["seq/log_ratio_sq"] >= last["seq/log_ratio"] ** 2 - 1e-6


@pytest.mark.slow  # ~30 s; its monitors are the trainer's (tests/method/diagnostics_test.py)
def test_length_stats_prints_a_row_per_noise_level(tmp_path):
    rows = length_stats.main(["--preset", "long", "--workdir", str(tmp_path), "--noise",
                              "0,0.4", "--batches", "1", *FAST, "rl.prompts_per_step=4",
                              "rl.group_size=4"])
    assert [r["noise"] for r in rows] == [0.0, 0.4]
    assert rows[1]["k1"] > rows[0]["k1"] and all(r["length"] >= 1 for r in rows)
    assert all(0 <= r["beyond_cap"] <= 1 and r["s_sd"] >= 0 for r in rows)


@pytest.mark.parametrize("name, preset", [(n, p) for n, d in ALL.items() for p in d.presets])
def test_every_preset_dry_runs_each_variant(name, preset, capsys):
    desc = ALL[name]
    exp = desc.presets[preset]()
    names = [v.name for v in exp.variants]
    assert len(exp.seeds) >= 2 and len(names) == len(set(names))
    assert desc.main(["--preset", preset, "--dry-run"]) == {}
    out = capsys.readouterr().out
    assert [line.split(" (seeds ")[0] for line in out.splitlines()
            if " (seeds " in line] == names


def test_dry_run_states_a_multi_slice_mesh(capsys):
    desc = ALL["onpolicy"]
    desc.main(["--dry-run", "--only", "minirl", "mesh=2,1,1", "mesh_dcn=2,1,1"])
    assert "mesh=(2, 1, 1) mesh_dcn=(2, 1, 1)" in capsys.readouterr().out
    desc.main(["--dry-run", "--only", "minirl"])
    assert "mesh_dcn" not in capsys.readouterr().out  # one slice: not said


@pytest.mark.parametrize("name", [n for n, d in ALL.items() if "paper" in d.presets])
def test_paper_preset_states_the_paper_settings(name, capsys):
    desc = ALL[name]
    exp = desc.presets["paper"]()
    desc.main(["--preset", "paper", "--dry-run"])
    out = capsys.readouterr().out
    assert "E=128 K=8" in out and "numerics=fp8" in out and "G=16" in out
    for v in exp.variants:
        cfg = exp.config(v, 0)
        per_minibatch = cfg.rl.prompts_per_step * cfg.rl.group_size // cfg.rl.num_minibatches
        assert per_minibatch == 1024  # the paper's mini-batch, at every N


def test_offpolicy_variants_fix_the_minibatch_and_scale_the_batch():
    exp = offpolicy.EXPERIMENTS["tiny"]()
    cfgs = {v.name: exp.config(v, 0) for v in exp.variants}
    assert {c.rl.num_minibatches for c in cfgs.values()} == set(offpolicy.NS)
    for c in cfgs.values():
        assert c.rl.prompts_per_step // c.rl.num_minibatches == 4
    assert not cfgs["N4-minirl-noclip"].loss.clip and cfgs["N4-minirl+R2"].loss.clip
    assert cfgs["N8-minirl+R3"].rl.replay == "r3"


def test_bad_arguments_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        onpolicy.main(["--only", "nope", "--dry-run"])
    assert "--only: unknown variant(s) ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        onpolicy.main(["--dry-run", "rl.replay=r9"])
    assert "replay: must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        onpolicy.main(["--dry-run", "--seeds", "a,b"])
    assert "--seeds" in capsys.readouterr().err


def test_seed_mean_and_summary_rows():
    a = [{"step": 0, "eval/accuracy": 0.2}, {"step": 1, "reward": 0.1, "entropy": 1.0},
         {"step": 2, "reward": 0.3, "entropy": 0.5, "eval/accuracy": 0.4}]
    b = [{"step": 0, "eval/accuracy": 0.4}, {"step": 1, "reward": 0.5, "entropy": 2.0},
         {"step": 2, "reward": None, "entropy": 1.5, "eval/accuracy": 0.2}]
    # float64 means of ≤ 2 decimal values: the decimals (1), Σ (1), ÷ (1), the expected
    # literal (1); a sample sd adds the deviations, squares, Σ, ÷ and √.
    approx = lambda x, n=4: pytest.approx(x, rel=bound(n, "float64"), abs=0)
    mean = report.seed_mean([a, b])
    assert mean[1] == {"step": 1, "reward": approx(0.3), "entropy": approx(1.5)}
    assert mean[2]["reward"] == approx(0.3)  # only one seed has a value
    (row,) = report.summary_rows({"v": [a, b]})
    # Final accuracy: the mean of each seed's last evaluations (0.3 and 0.3).
    assert row["acc_start"] == approx(0.3) and row["acc_end"] == approx(0.3)
    assert row["acc_best"] == approx(0.4)  # per-seed best 0.4 and 0.4
    assert row["acc_end_sd"] == pytest.approx(0.0, abs=bound(9, "float64"))
    assert row["collapsed"] == 0 and row["collapse"] == 3  # too short: censored at 2 + 1
    assert row["reward_first"] == approx(0.3) and row["entropy_last"] == approx(1.0)
    table = report.markdown_table([row])
    assert table.splitlines()[2].startswith("| v | 2 | 0.300 | 0.400 | 0.300 |")


def test_per_seed_rows_carry_the_sequence_log_ratio():
    """One row per run with its seed; the per-response log-ratio s and the share of
    sequence weights beyond the cap are averaged over the first / last fifth and all
    steps, and the per-run table shows them."""
    s_ = [-1.0, -2.0, -3.0, -4.0, -5.0]
    runs = [[{"step": 0, "eval/accuracy": 0.1}]
            + [{"step": i + 1, "reward": 0.2, "seq/log_ratio": s, "seq/beyond_cap": 0.5 * i,
                "routing/mismatch_rate": 0.1} for i, s in enumerate(s_)]]
    (row,) = report.per_seed_rows({"v": runs}, {"v": (7,)})
    assert row["variant"] == "v" and row["seed"] == 7
    assert row["seq_first"] == -1.0 and row["seq_last"] == -5.0  # fifths of 5 steps: 1 step
    # (0 + 0.5 + 1 + 1.5 + 2) / 5 in float64: five exact sums and one rounded division.
    assert row["beyond_cap"] == pytest.approx(1.0, rel=bound(1, "float64"), abs=0)
    table = report.markdown_table([row], report.PER_SEED_KEYS).splitlines()
    assert table[0].split(" | ")[:2] == ["| variant", "seed"]
    assert "E[s] first⅕" in table[0] and "π/μ > cap" in table[0]
    assert "routing mismatch" not in table[0]  # only the per-run keys
    assert table[2].startswith("| v | 7 | 0.100 |") and "| -1.0 | -5.0 | 1.000 |" in table[2]


def _records(rewards, evals=()):
    recs = [{"step": 0}] + [{"step": i + 1, "reward": r} for i, r in enumerate(rewards)]
    for step, acc in evals:
        recs[step]["eval/accuracy"] = acc
    return recs


def test_collapse_step_and_final_accuracy():
    steady = [0.4] * 30
    # After step 20 the reward drops to 0.1: a 10-step mean holding k of those is
    # 0.4 − 0.03·k, below half the best (0.2) from k = 7 on (0.19; k = 6 gives 0.22),
    # the window ending at step 27.
    crash = [0.4] * 20 + [0.1] * 10
    assert stats.collapse_step(_records(steady)) == 31  # never: censored at 30 + 1
    assert stats.collapse_step(_records(crash)) == 27
    recs = _records(steady, [(0, 0.1), (10, 0.2), (20, 0.3), (30, 0.7)])
    assert stats.final_accuracy(recs) == pytest.approx(0.4, rel=bound(4, "float64"))


def test_intervals_paired_and_welch():
    a, b = [0.5, 0.6, 0.7, 0.8], [0.4, 0.45, 0.65, 0.7]
    d = np.subtract(a, b)  # 0.1, 0.15, 0.05, 0.1: sd 0.0408, t(0.975, 3) = 3.182446
    diff, lo, hi = stats.interval(a, b, paired=True)
    half = 3.182446305284263 * np.std(d, ddof=1) / 2
    assert diff == pytest.approx(0.1) and (lo, hi) == pytest.approx((0.1 - half, 0.1 + half))
    _, wlo, whi = stats.interval(a, b, paired=False)
    assert wlo < lo and whi > hi  # the unpaired interval ignores the shared seeds: wider
    rows = stats.compare({"A": dict(enumerate(_records([0.5] * 12, [(12, x)] ) for x in a)),
                          "B": dict(enumerate(_records([0.5] * 12, [(12, x)]) for x in b))},
                         "A", "B")
    acc = next(r for r in rows if r["outcome"] == "final accuracy")
    assert acc["verdict"] == "A > B" and acc["seeds"] == 4
    assert "| A | B | final accuracy | 4 |" in stats.markdown(rows)


def test_mismatch_sweep_compares_each_level():
    names = [v.name for v in mismatch_sweep.VARIANTS]
    pairs = mismatch_sweep.comparisons(names)
    assert len(pairs) == len(mismatch_sweep.LEVELS)
    assert all(a.endswith("-noIS") and b in names for a, b in pairs)


def test_quickstart_is_the_training_run_under_its_former_name(monkeypatch):
    """`python -m experiments.quickstart` runs experiments.train's main with its old
    default workdir, so a run started under that name resumes under it."""
    import runpy

    from experiments import train
    calls = []
    monkeypatch.setattr(train, "main", lambda **kw: calls.append(kw))
    # Not imported before: runpy would warn that it runs a module already in sys.modules.
    monkeypatch.delitem(sys.modules, "experiments.quickstart", raising=False)
    runpy.run_module("experiments.quickstart", run_name="__main__")
    assert calls == [{"default_workdir": "runs/quickstart"}]
