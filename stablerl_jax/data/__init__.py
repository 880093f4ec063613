"""Data for RL on verifiable tasks, all host-side (numpy, no TensorFlow).

    task.py          front door: load_split, TaskData (splits, eval sets, tokenizer,
                     rendering, length filter, batches, rewards)
    synthetic.py     arithmetic TFDS builder (difficulties: presets.TASKS)
    jsonl.py         TFDS builder over local math JSONL / parquet files (never downloaded)
    parquet.py       verl-layout parquet files, read row by row as JSONL records
    formats.py       JSONL layouts (gsm8k, math, dapo, aime, prompt_answer, custom)
    chat_template.py the checkpoint's jinja chat template, rendered as transformers does
    tokenizer.py     Tokenizer protocol; SentencePiece trained in-process, saved and reused
    hf_tokenizer.py  a checkpoint's tokenizer.json, its special and stop ids
    batching.py      left-padded RL prompt groups, SFT batches, seeded epoch order
    answers.py       final-answer extraction (after </think>; boxed, ####, "the answer is")
    rewards.py       exact-match, math-verify and format rewards, with the extractor used
    accuracy.py      avg@k / pass@k on held-out problems given any sampler
    sft_data.py      cold-start records → chats → token ids and the loss mask
    template_sandbox.py, template_sizes.py  a chat template's jinja sandbox, size estimates
"""
