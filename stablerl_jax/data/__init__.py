"""Data for RL on verifiable tasks, all host-side (numpy, no TensorFlow).

    synthetic.py   TaskConfig, difficulty PRESETS, the arithmetic TFDS builder, load_split
    gsm8k.py       TFDS builder over local GSM8K-style JSONL files (never downloaded)
    tokenizer.py   Tokenizer protocol; SentencePiece trained in-process, saved and reused
    batching.py    left-padded prompt groups for RL, SFT batches, seeded epoch order
    rewards.py     final-answer parser; exact-match, math-verify and format rewards
    evaluation.py  avg@k / pass@k on held-out problems given any sampler
"""
