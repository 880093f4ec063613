"""Interoperation with the outside world: Hugging Face Qwen3-MoE checkpoints in and out
(`hf_config`, `hf_checkpoint`), and rollouts recorded by an external inference engine
(vLLM / SGLang routes, offline rollout files: `rollouts`)."""
