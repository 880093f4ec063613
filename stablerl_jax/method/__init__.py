"""The paper's method as pure functions over arrays: what a token's loss, advantage and
monitors are, independent of how a run is driven (docs/method.md).

    losses.py        the first-order surrogate losses (MiniRL, Eq. 7, and its ablations)
    loss_table.py    the old name of config/loss_table.py (the losses' table: each
                     loss's function, knobs and aggregation), kept for old imports
    advantages.py    group baselines (GRPO mean, leave-one-out, standardized)
    overlong.py      DAPO's soft over-long penalty and the length monitors
    logprobs.py      token log-probs and entropy, from hidden states or from tokens
    mismatch.py      training–inference mismatch of a rollout (k1, k3, flips)
    attribution.py   a per-token split of that mismatch into its causes
    centering.py     score centering (E_q[∇ log π] removed) and the drift q − π it targets
    diagnostics.py   every monitor of the trainer and its (numerator, denominator) pairs
"""
