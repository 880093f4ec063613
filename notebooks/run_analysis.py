# %% [markdown]
# # Analysing a run
#
# Every run writes one JSON row of floats per global step to `<workdir>/metrics.jsonl`
# (the source of truth; TensorBoard files and PNGs are derived from it). This notebook
# loads a workdir — the quickstart's by default, or the one named by the environment
# variable `STABLERL_WORKDIR` — and plots the monitors the experiments report: reward,
# held-out accuracy, full-vocabulary entropy, training–inference KL (log scale),
# clip / mask fractions, routing mismatch and the Eq. 5 factors.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np

from stablerl_jax.metrics_io import PANELS, plot_comparison, read_metrics

workdir = os.environ.get("STABLERL_WORKDIR", "runs/quickstart")
records = read_metrics(workdir)
assert records, f"no metrics.jsonl in {workdir!r}; run `python -m experiments.quickstart` first"
print(f"{workdir}: {len(records)} rows, steps {records[0]['step']}..{records[-1]['step']}")
keys = sorted({k for r in records for k in r if k != "step"})
print(f"{len(keys)} metrics, e.g. {keys[:8]}")

# %% [markdown]
# ## Start vs end
# Held-out accuracy (avg@k) is logged at step 0 and every `rl.eval_every` steps; the
# other monitors every step.

# %%
evals = [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]
print("held-out accuracy by step:", ", ".join(f"{s}: {a:.3f}" for s, a in evals))
steps_ = [r for r in records if r.get("reward") is not None]
for key in ("reward", "entropy", "kl/train_infer_k1", "routing/mismatch_rate"):
    vals = [r[key] for r in steps_ if r.get(key) is not None]
    if vals:
        w = max(1, len(vals) // 5)
        print(f"{key:24s} first fifth {np.mean(vals[:w]):.4g}   last fifth {np.mean(vals[-w:]):.4g}")

# %% [markdown]
# ## The monitors, one panel each
# `plot_comparison` takes `{label: records}`; pass several workdirs to overlay runs.

# %%
path = plot_comparison({os.path.basename(os.path.normpath(workdir)): records},
                       "run_analysis.png", PANELS)
img = plt.imread(path)
plt.figure(figsize=(12, 12 * img.shape[0] / img.shape[1]))
plt.imshow(img)
plt.axis("off")
plt.show()

# %% [markdown]
# ## Reward with a moving average
# With 16 prompts per step the per-step reward is noisy; a 10-step moving average shows the
# trend.

# %%
x = np.array([r["step"] for r in steps_])
y = np.array([r["reward"] for r in steps_])
w = min(10, len(y))
plt.figure(figsize=(6, 3))
plt.plot(x, y, ".", alpha=0.4, label="per step")
plt.plot(x[w - 1:], np.convolve(y, np.ones(w) / w, mode="valid"), label=f"{w}-step mean")
plt.xlabel("step")
plt.ylabel("training reward")
plt.legend()
plt.show()
