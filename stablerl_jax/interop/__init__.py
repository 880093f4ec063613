"""Interoperation with the outside world.

    hf_config.py      Hugging Face `Qwen3MoeConfig` (config.json) ↔ `ModelConfig`
    hf_layout.py      the name map: each of our parameters ↔ its HF tensor(s), and how
    hf_checkpoint.py  Qwen3-MoE safetensors in (`load_qwen3_moe`), config.json checked first
    hf_export.py      ... and out (`save_qwen3_moe`), with tokenizer files: servable as is
    hf_validate.py    what a checkpoint's tensors must hold before training starts
    rollouts.py       rollouts recorded by vLLM / SGLang: their routes as our replay
    parity.py         the old name of `python -m experiments.parity`
"""
