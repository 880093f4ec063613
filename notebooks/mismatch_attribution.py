# %% [markdown]
# # Where a run's training–inference mismatch comes from
#
# A run with `rl.attribution=true` splits each scored token's log π_θ − log μ into three
# parts that add up to it (`stablerl_jax/method/attribution.py`, docs/method.md §11):
#
# - **precision**: log π(θ_old, the sampler's experts) − log μ, the arithmetic alone;
# - **routing**: log π_old − log π(θ_old, the sampler's experts), the trainer's experts
#   against the sampler's (0 under R3; `routing_cf` is the same comparison with the
#   trainer's live routes, logged in every mode);
# - **staleness**: log π_θ − log π_old, Eq. 5's second factor.
#
# This notebook reads a workdir (`STABLERL_WORKDIR`, default `runs/attribution`): the
# per-step moments in `metrics.jsonl` and the probed rows in `attribution.jsonl`
# (every `rl.attribution_every` steps), and shows which parts and which tokens grow
# before the run collapses (the reward criterion of the experiment reports), or from the
# first to the last fifth of a run that does not.

# %%
import json
import os
import sys

import matplotlib.pyplot as plt
import numpy as np

# The experiments' package (its collapse criterion) from the repository root, where this
# notebook runs from the root or from notebooks/.
sys.path.insert(0, os.path.abspath(".." if os.path.isdir("../experiments") else "."))
from experiments import stats  # noqa: E402
from stablerl_jax.method.attribution import BINS, PARTS  # noqa: E402
from stablerl_jax.runs import storage  # noqa: E402
from stablerl_jax.runs.metrics_io import read_metrics  # noqa: E402

default = "runs/attribution" if os.path.isdir("runs") else "../runs/attribution"
workdir = os.environ.get("STABLERL_WORKDIR", default)
records = [r for r in read_metrics(workdir) if r.get("attr/total_mean") is not None]
assert records, f"no attribution rows in {workdir!r}; train with rl.attribution=true"
dump_path = os.path.join(workdir, "attribution.jsonl")
dumps = ([json.loads(line) for line in storage.read_text(dump_path).splitlines() if line]
         if storage.exists(dump_path) else [])
steps = np.array([r["step"] for r in records])
collapse = stats.collapse_step(read_metrics(workdir))
collapsed = collapse <= steps[-1]
w = max(1, len(records) // 5)
first = records[:w]
# The window before the collapse (or the last fifth of a run without one).
end = int(np.searchsorted(steps, collapse)) if collapsed else len(records)
before = records[max(0, end - w):end] or records[-w:]
print(f"{workdir}: {len(records)} steps with attribution, {len(dumps)} probed rows; "
      + (f"collapse at step {collapse}" if collapsed else "no collapse"))
window = (f"steps {before[0]['step']}–{before[-1]['step']}")

def mean_of(rows, key):
    """The mean of a metric over rows that have it (NaN when none does)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else float("nan")


# %% [markdown]
# ## The parts per step
# Their means add up to the total's (the split is exact per token), and their shares of
# the total's variance, Cov(part, total) / Var(total), add up to 1.

# %%
for r in records:
    assert abs(sum(r[f"attr/{p}_mean"] for p in PARTS) - r["attr/total_mean"]) <= 1e-5 * max(
        1.0, abs(r["attr/total_mean"]))
    shares = [r.get(f"attr/{p}_share") for p in PARTS]  # None where Var(total) = 0
    assert None in shares or abs(sum(shares) - 1) < 1e-6, shares
print(f"{'part':12s} {'E[x²] first fifth':>18s} {'E[x²] ' + window:>24s} "
      f"{'share first':>12s} {'share later':>12s}")
for p in PARTS + ("routing_cf", "total"):
    share = (lambda rows: mean_of(rows, f"attr/{p}_share")) if p in PARTS else (
        lambda rows: float("nan"))
    print(f"{p:12s} {mean_of(first, f'attr/{p}_sqmean'):18.3e} "
          f"{mean_of(before, f'attr/{p}_sqmean'):24.3e} {share(first):12.3f} "
          f"{share(before):12.3f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
for p in PARTS + ("routing_cf",):
    axes[0].plot(steps, [r[f"attr/{p}_sqmean"] for r in records], label=p)
    if p in PARTS:
        axes[1].plot(steps, [r[f"attr/{p}_share"] for r in records], label=p)
axes[0].set_yscale("log")
axes[0].set_title("mean square of each part")
axes[1].set_title("share of Var(log π_θ − log μ)")
for ax in axes:
    ax.set_xlabel("step")
    if collapsed:
        ax.axvline(collapse, color="k", ls=":", lw=1)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Which tokens carry it
# Each bin's share of the total's mean square: (tokens in the bin / tokens) × E[x² | bin]
# / E[x²], by the sampler's probability of the sampled token, the trainer's entropy at
# it, and its third of the response.

# %%
for family, _, labels in BINS:
    print(f"by {family}:")
    for label in labels:
        key = f"attr_bin/{family}_{label}"
        carried = lambda rows: mean_of(rows, f"{key}/share") * mean_of(
            rows, f"{key}/total_sqmean") / mean_of(rows, "attr/total_sqmean")
        tokens = lambda rows: mean_of(rows, f"{key}/share")
        print(f"  {label:8s} tokens {tokens(first):.3f} → {tokens(before):.3f}   "
              f"share of E[x²] {carried(first):.3f} → {carried(before):.3f}   "
              + "  ".join(f"E[{p}²] {mean_of(before, f'{key}/{p}_sqmean'):.2e}"
                          for p in PARTS))

# %% [markdown]
# ## The routing part by layer
# From the probes: layer l's share E[s_l · routing_cf] / E[routing_cf²], where s_l is
# the change of log π when only layer l takes the sampler's experts; what the layers'
# effects do not add up to is the interaction (a flip changes what later layers see).

# %%
layer_keys = sorted((k for k in records[-1] if k.startswith("attr_layer/l")
                     and k.endswith("_share")), key=lambda k: int(k[len("attr_layer/l"):-6]))
probed = [r for r in records if r.get("attr_layer/interaction_share") is not None]
if probed:
    for k in layer_keys + ["attr_layer/interaction_share"]:
        print(f"{k:32s} first {mean_of(probed[:max(1, len(probed) // 5)], k):+.3f}   "
              f"last {mean_of(probed[-max(1, len(probed) // 5):], k):+.3f}")
    plt.figure(figsize=(6, 3))
    for k in layer_keys + ["attr_layer/interaction_share"]:
        plt.plot([r["step"] for r in probed], [mean_of([r], k) for r in probed],
                 marker=".", label=k.split("/")[1])
    plt.xlabel("step")
    plt.title("share of the routing part by layer")
    plt.legend(fontsize=7)
    plt.show()
else:
    print("no probe step carried a routing part (no expert flipped on the probed rows)")

# %% [markdown]
# ## The tokens with the largest mismatch in the last probe before the collapse
# (or the last probe of the run): their text, μ, the parts and the layers whose experts
# differ between the sampler and live routing.

# %%
last_step = max((d["step"] for d in dumps if d["step"] <= before[-1]["step"]), default=None)
if last_step is not None:
    tokens = [(d, t) for d in dumps if d["step"] == last_step for t in range(len(d["ids"]))]
    for d, t in tokens:
        total = d["logp_theta"][t] - d["logp_mu"][t]
        assert abs(sum(d[p][t] for p in PARTS) - total) <= 1e-3 * max(1.0, abs(total))
    tokens.sort(key=lambda dt: -abs(dt[0]["logp_theta"][dt[1]] - dt[0]["logp_mu"][dt[1]]))
    print(f"step {last_step}: {len(tokens)} probed tokens; the 10 largest |log π_θ − log μ|")
    print(f"{'token':>12s} {'μ':>7s} {'entropy':>8s} "
          + " ".join(f"{p:>10s}" for p in PARTS) + "  flipped layers")
    for d, t in tokens[:10]:
        print(f"{d['tokens'][t]!r:>12s} {np.exp(d['logp_mu'][t]):7.3f} "
              f"{d['entropy'][t]:8.3f} " + " ".join(f"{d[p][t]:+10.2e}" for p in PARTS)
              + f"  {d['flipped_layers'][t]}")
