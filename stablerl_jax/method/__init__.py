"""The paper's method as pure array functions, independent of the run's driver (docs/method.md):
    losses.py       first-order surrogate losses (MiniRL, Eq. 7, and its ablations)
    loss_table.py   old-import name of config/loss_table.py (function, knobs, aggregation)
    advantages.py   group baselines (GRPO mean, leave-one-out, standardized)
    overlong.py     DAPO's soft over-long penalty, the length monitors
    logprobs.py     token log-probs and entropy, from hidden states or tokens
    mismatch.py     training–inference mismatch of a rollout (k1, k3, flips)
    attribution.py  a per-token split of that mismatch into its causes
    centering.py    score centering (E_q[∇ log π] removed), the drift q − π it targets
    diagnostics.py  every trainer monitor and its (numerator, denominator) pairs
"""
