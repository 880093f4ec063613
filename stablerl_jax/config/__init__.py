"""Every setting of an experiment: frozen dataclasses, validated on construction.

    ExperimentConfig                            (experiment.py)
      model     ModelConfig     the Qwen3-MoE decoder (vocab_size is stated here only)
      task      TaskConfig      data and token budgets                    (task.py)
      sampling  SamplingConfig  the inference engine: decoding and its numerics (model.py)
      loss      LossConfig      the surrogate loss (MiniRL by default)    (training.py)
      rl        RLConfig        the global-step loop, its cadence and `rl.optim`
      sft       SFTConfig       the cold start and `sft.optim`
      mesh                      (data, fsdp, expert) device mesh of every jitted step
      mesh_dcn                  the slices each mesh axis spans (multi-slice TPU jobs)

choices.py: the allowed values of every choice field (dtypes, the losses' table `LOSS_TABLE` of
loss_table.py, the kernels' `LOGPROB_IMPLS`, `GMM_IMPLS`, `DECODE_IMPLS`, …); checks.py:
`ConfigError` and the checks; combinations.py: settings that cannot work together, and sizes
bounded by what a run can use. Every name is importable from `stablerl_jax.config`.

Every check raises `ConfigError` naming the field, the bad value and the fix; nothing is fixed
silently. `apply_overrides` applies `section.field=value` strings (nested:
`rl.optim.learning_rate`) at once, then validates, so overrides that only make sense together
(`task.kind=jsonl task.jsonl_dir=…`) work in any order. A leaf package: it imports no model, data
or training code, only the kernels' JAX-free tables of implementation names; special token ids
are the tokenizer's (`data.tokenizer`), dtypes the model's (`model.numerics.dtype_of`)."""
from stablerl_jax.config.checks import (ConfigError, Section, check, check_bool, check_choice,
                                        check_positive_int, is_finite, is_int)
from stablerl_jax.config.choices import (ADVANTAGE_NAMES, AGGREGATIONS, ATTENTION_IMPLS,
                                         DATA_FORMATS, DECODE_IMPLS, DTYPES, EVAL_SET_NAME,
                                         GMM_IMPLS, INFERENCE_NUMERICS, IS_CORRECTIONS,
                                         KV_CACHE_LAYOUTS,
                                         LOGPROB_IMPLS, LOSS_NAMES, LOSS_TABLE, OPERATORS,
                                         OVERLONG_MODES, REMAT_POLICIES, REPLAY_MODES,
                                         ROW_DENOMINATORS, SAMPLER_LAYOUTS,
                                         SFT_FORMATS, STYLES, TASK_KINDS)
from stablerl_jax.config.experiment import (ExperimentConfig, apply_overrides, changed_fields,
                                            flat_dict)
from stablerl_jax.config.model import ModelConfig, SamplingConfig
from stablerl_jax.config.task import TaskConfig
from stablerl_jax.config.training import (LossConfig, OptimConfig, RLConfig, SFTConfig,
                                          parse_eval_sets)

__all__ = [
    "ADVANTAGE_NAMES", "AGGREGATIONS", "ATTENTION_IMPLS", "ConfigError", "DATA_FORMATS",
    "DECODE_IMPLS", "DTYPES", "EVAL_SET_NAME", "ExperimentConfig", "GMM_IMPLS",
    "INFERENCE_NUMERICS", "IS_CORRECTIONS", "KV_CACHE_LAYOUTS", "LOGPROB_IMPLS", "LOSS_NAMES",
    "LOSS_TABLE", "LossConfig", "ModelConfig", "OPERATORS", "OVERLONG_MODES", "OptimConfig",
    "REMAT_POLICIES", "REPLAY_MODES", "ROW_DENOMINATORS", "RLConfig", "SAMPLER_LAYOUTS",
    "SFTConfig", "SFT_FORMATS", "STYLES", "SamplingConfig",
    "Section", "TASK_KINDS", "TaskConfig", "apply_overrides", "changed_fields", "check",
    "check_bool", "check_choice", "check_positive_int", "flat_dict", "is_finite", "is_int",
    "parse_eval_sets",
]
