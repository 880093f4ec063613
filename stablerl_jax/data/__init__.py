"""Data for RL on verifiable tasks, all host-side (numpy, no TensorFlow).

    task.py          the front door: load_split, TaskData (splits, eval sets, tokenizer,
                     rendering, length filter, batches, rewards)
    synthetic.py     the arithmetic TFDS builder (its difficulties: presets.TASKS)
    jsonl.py         TFDS builder over math JSONL and parquet files (never downloaded)
    parquet.py       parquet data files (verl's layout), read row by row into the records
                     a JSONL line becomes
    formats.py       JSONL layouts (gsm8k, math, dapo, aime, prompt_answer, custom)
    chat_template.py the checkpoint's jinja chat template, rendered as transformers does
    tokenizer.py     Tokenizer protocol; SentencePiece trained in-process, saved and reused
    hf_tokenizer.py  a checkpoint's tokenizer.json, its special and stop ids
    batching.py      left-padded prompt groups for RL, SFT batches, seeded epoch order
    answers.py       final-answer extraction (after </think>; boxed, ####, "the answer is")
    rewards.py       exact-match, math-verify and format rewards, with the extractor used
    accuracy.py      avg@k / pass@k on held-out problems given any sampler
    sft_data.py      cold-start records → chats → token ids and the loss mask
    template_sandbox.py the jinja environment a chat template renders in
    template_sizes.py   how long its text can get, estimated before it is built
"""
