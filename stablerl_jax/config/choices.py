"""The allowed values of every choice field: sections validate against these tuples, the rest of
the package reads them here. Kernel implementation names are their ops' tables
(kernels/*_impls.py), loss names the losses' table (stablerl_jax/config/loss_table.py); both are
JAX-free and read live, so a row registered there is a valid choice."""
import re

from stablerl_jax.kernels.decode_attention_impls import DECODE_IMPLS
from stablerl_jax.kernels.fused_logprob_impls import LOGPROB_IMPLS
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS
from stablerl_jax.config.loss_table import AGGREGATIONS, LOSS_TABLE

DTYPES = ("float32", "bfloat16", "float16", "float64")  # float64: reference runs under x64
INFERENCE_NUMERICS = ("exact", "bitwise", "bf16", "fp8")  # sampler presets of model.numerics
LOSS_NAMES = tuple(LOSS_TABLE)  # at import; LossConfig.name is checked against the table
IS_CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_product", "seq_geomean")
# The rows a row-mean aggregation divides by (LossConfig.row_denominator).
ROW_DENOMINATORS = ("scored", "all")
CENTER_MODES = ("none", "exact", "topk")  # score centering's q (method/centering.py)
TRUST_REGIONS = ("none", "k1", "abs")  # the per-token divergence of trust-region masking
ADVANTAGE_NAMES = ("group_mean", "group_norm", "leave_one_out")
REPLAY_MODES = ("none", "r2", "r3")
OVERLONG_MODES = ("keep", "mask", "penalty")  # what a truncated response trains on
OLD_POLICIES = ("behavior", "proximal")  # π_old of partial rollouts (rl.old_policy)
REMAT_POLICIES = ("none", "full", "dots")  # what a layer saves for the backward pass
ATTENTION_IMPLS = ("naive", "chunked", "causal")
SAMPLER_LAYOUTS = ("train", "serve")  # SamplingConfig.layout
KV_CACHE_LAYOUTS = ("bskd", "bksd")  # a layer's cache: [B, S, KV, Dh] or [B, KV, S, Dh]
TASK_KINDS = ("arithmetic", "jsonl", "gsm8k")  # 'gsm8k': the former name of 'jsonl'
DATA_FORMATS = ("auto", "gsm8k", "math", "dapo", "aime", "prompt_answer", "custom")
EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")
STYLES = ("steps", "rewrite", "terse")
# Cold-start data layouts (data/sft_data.py): chats, prompt/response pairs, and the math
# formats that carry worked solutions.
SFT_FORMATS = ("auto", "messages", "prompt_response", "gsm8k", "math")
OPERATORS = ("+-", "+")
