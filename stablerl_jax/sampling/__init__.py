"""The inference engine μ: sampling with its own numerics, apart from the trainer's.

    rollout.py        prefill + KV-cache decode of a static batch (`sample`), `Rollout`
    continuous.py     continuous batching: a finished row's slot is refilled
    bitwise_check.py  the old name of `python -m experiments.bitwise_check`
"""
