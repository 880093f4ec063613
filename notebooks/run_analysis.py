# %% [markdown]
# # Analysing a run
#
# Every run writes one JSON row of floats per global step to `<workdir>/metrics.jsonl`
# (the source of truth; TensorBoard files and PNGs are derived from it). This notebook
# loads a workdir — the training run's by default, or the one named by the environment
# variable `STABLERL_WORKDIR` (several, separated by `:`, are overlaid) — and plots the
# monitors the experiments report: reward, held-out accuracy, full-vocabulary entropy,
# training–inference KL (log scale), clip / IS-truncation fractions, routing mismatch and
# the Eq. 5 factors (engine π_old/μ_old and staleness π_θ/π_old).

# %%
import os

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, display

from stablerl_jax.runs.metrics_io import PANELS, plot_comparison, read_metrics

# Relative to the repository root, or to notebooks/ (where Jupyter starts the kernel).
default = "runs/train" if os.path.isdir("runs") else "../runs/train"
workdirs = os.environ.get("STABLERL_WORKDIR", default).split(os.pathsep)
runs = {}
for workdir in workdirs:
    records = read_metrics(workdir)
    assert records, f"no metrics.jsonl in {workdir!r}; run `python -m experiments.train` first"
    runs[os.path.basename(os.path.normpath(workdir))] = records
    print(f"{workdir}: {len(records)} rows, steps {records[0]['step']}..{records[-1]['step']}")
keys = sorted({k for records in runs.values() for r in records for k in r if k != "step"})
print(f"{len(keys)} metrics, e.g. {keys[:8]}")

# %% [markdown]
# ## Start vs end
# Held-out accuracy (avg@k) is logged at step 0 and every `rl.eval_every` steps; the
# other monitors every step. The training–inference KL is the k1 estimate of
# KL(μ_old‖π_old) on the sampled tokens (unbiased, so a single batch can be below zero);
# the routing mismatch is the fraction of top-k expert slots on which the inference and
# training engines disagree.

# %%
for name, records in runs.items():
    evals = [(r["step"], r["eval/accuracy"]) for r in records
             if r.get("eval/accuracy") is not None]
    print(f"{name}: held-out accuracy by step:", ", ".join(f"{s}: {a:.3f}" for s, a in evals))
    for key in ("reward", "entropy", "kl/train_infer_k1", "routing/mismatch_rate"):
        vals = [r[key] for r in records if r.get(key) is not None]
        if vals:
            w = max(1, len(vals) // 5)
            print(f"  {key:24s} first fifth {np.mean(vals[:w]):.4g}   "
                  f"last fifth {np.mean(vals[-w:]):.4g}")

# %% [markdown]
# ## The monitors, one panel each
# `plot_comparison` draws `metrics_io.PANELS` (those with data) for `{label: records}`,
# one line per run; it is the figure the experiment drivers write as `comparison*.png`.
# `plot_metrics(records, out_dir)` writes the same panels as one PNG each.

# %%
display(Image(plot_comparison(runs, "run_analysis.png", PANELS)))

# %% [markdown]
# ## Reward with a moving average
# With 16 prompts per step the per-step reward is noisy; a 10-step moving average shows
# the trend.

# %%
plt.figure(figsize=(6, 3))
for i, (name, records) in enumerate(runs.items()):
    rows = [r for r in records if r.get("reward") is not None]
    x = np.array([r["step"] for r in rows])
    y = np.array([r["reward"] for r in rows])
    w = min(10, len(y))
    plt.plot(x, y, ".", color=f"C{i}", alpha=0.3)
    plt.plot(x[w - 1:], np.convolve(y, np.ones(w) / w, mode="valid"), color=f"C{i}",
             label=f"{name} ({w}-step mean)")
plt.xlabel("step")
plt.ylabel("training reward")
plt.legend(fontsize=8)
plt.show()
