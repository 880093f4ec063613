"""A new kernel implementation is one function named after its row and that row of its
op's table (docs/architecture.md, "Add a kernel"): registered there and nowhere else, it
is a valid config choice, it runs through the model, it joins the kernel tests'
parametrization and the AOT kernel list. Here existing implementations are registered
again under new names (monkeypatch restores the tables). And the table and the
implementations the op's modules define are one list: neither has a row the other lacks."""
import dataclasses
import importlib
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import impls_here

from stablerl_jax import kernels, presets
from stablerl_jax.config import ConfigError, ModelConfig, RLConfig
from stablerl_jax.kernels.decode_attention_impls import (
    DECODE_IMPLS,
    DecodeImpl,
    decode_example_args,
)
from stablerl_jax.kernels.fused_logprob_impls import (
    LOGPROB_IMPLS,
    LogprobImpl,
    logprob_example_args,
)
from stablerl_jax.kernels.gmm_impls import GMM_IMPLS, GmmImpl, gmm_example_args
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import transformer as tf
from stablerl_jax.pod import aot

CFG = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=8, num_experts=4, top_k=2, expert_ffn_dim=16, max_seq_len=16,
                  moe_tile=4)


@pytest.fixture
def tables(monkeypatch):
    """The reference of each op under a second name, and each op's TPU kernel too."""
    for table, ref, tpu in ((LOGPROB_IMPLS, "naive", "pallas_tpu"),
                            (GMM_IMPLS, "loop", "pallas_tpu"),
                            (DECODE_IMPLS, "blocks", "pallas_tpu")):
        monkeypatch.setitem(table, f"{ref}_again", table[ref])
        monkeypatch.setitem(table, f"{tpu}_again", table[tpu])


def _inputs():
    params = tf.init_params(jax.random.key(0), CFG)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, CFG.vocab_size)
    return params, tokens, jnp.ones((3, 9), bool).at[0, :2].set(False)


def test_a_new_row_is_a_config_choice(tables):
    assert RLConfig(logprob_impl="naive_again").logprob_impl == "naive_again"
    assert CFG.replace(gmm_impl="loop_again").gmm_impl == "loop_again"
    assert CFG.replace(decode_attention_impl="blocks_again").decode_attention_impl == \
        "blocks_again"
    # What a decode row needs of the cache is read from the row: a ragged one, a blocked
    # head-major cache.
    with pytest.raises(ConfigError, match="decode_attention_impl: .*kv_cache_layout=bksd"):
        CFG.replace(decode_attention_impl="pallas_tpu_again")
    assert CFG.replace(decode_attention_impl="pallas_tpu_again", decode_block=8,
                       kv_cache_layout="bksd").decode_attention_impl == "pallas_tpu_again"


def test_without_its_row_a_name_is_refused():
    with pytest.raises(ConfigError, match="logprob_impl: must be one of"):
        RLConfig(logprob_impl="naive_again")
    with pytest.raises(ConfigError, match="gmm_impl: must be one of"):
        CFG.replace(gmm_impl="loop_again")


def test_a_new_row_runs_through_the_model(tables):
    """policy_logprobs with the new log-prob row, and the model's forward with the new
    grouped matmul row, give what the rows they copy give (bitwise: the same function)."""
    params, tokens, attn = _inputs()
    run = lambda impl, cfg: jax.jit(lambda p: policy_logprobs(p, tokens, attn, cfg,
                                                              impl=impl)[:2])(params)
    for got, want in zip(run("naive_again", CFG.replace(gmm_impl="loop_again")),
                         run("naive", CFG.replace(gmm_impl="loop"))):
        np.testing.assert_array_equal(got, want)


def test_a_new_row_joins_the_kernel_tests(tables):
    assert {"naive_again", "loop_again", "blocks_again"} <= set(impls_here(LOGPROB_IMPLS)) | set(
        impls_here(GMM_IMPLS)) | set(impls_here(DECODE_IMPLS))


def test_a_new_tpu_kernel_joins_the_aot_kernel_list(tables):
    """The list and the abstract arguments only: compiling for TPU is the `tpu` tests'."""
    cfg = presets.preset("tiny", ["mesh=1,1,1"])
    programs = {label: args for label, _, args in
                aot.kernel_programs(cfg, jax.devices("cpu")[:1])}
    tokens = {name: row.tokens for name, row in DECODE_IMPLS.items() if row.tokens}
    assert set(programs) == {f"{op} {name} {kind}" for op, table, kind in
                             (("logprob", LOGPROB_IMPLS, "fwd+bwd"),
                              ("gmm", GMM_IMPLS, "fwd+bwd"),
                              ("decode_attention", DECODE_IMPLS, "fwd"),
                              ("decode_attention tokens", tokens, "fwd"))
                             for name, row in table.items()
                             if row.pallas and "tpu" in row.backends}
    assert "decode_attention tokens pallas_tpu_again fwd" in programs
    for op, kind in (("logprob", "fwd+bwd"), ("gmm", "fwd+bwd"), ("decode_attention", "fwd"),
                     ("decode_attention tokens", "fwd")):
        new, old = programs[f"{op} pallas_tpu_again {kind}"], programs[f"{op} pallas_tpu {kind}"]
        assert [(a.shape, a.dtype) for a in new] == [(a.shape, a.dtype) for a in old]
    # The update's tokens per chip: one micro-batch's rows times the T = S − 1 positions.
    rl, task = cfg.rl, cfg.task
    t = (rl.prompts_per_step * rl.group_size // rl.num_minibatches // rl.microbatches
         * (task.max_prompt_len + cfg.sampling.max_new_tokens - 1))
    mc = cfg.model
    hidden, unembed, targets, g_logp, g_ent = programs["logprob pallas_tpu fwd+bwd"]
    assert (hidden.shape, unembed.shape, targets.shape, g_logp.shape) == (
        (t, mc.d_model), (mc.d_model, mc.vocab_size), (t,), (t,))
    lhs, rhs, sizes, cot = programs["gmm pallas_tpu fwd+bwd"]
    assert rhs.shape == (mc.num_experts, mc.d_model, mc.expert_ffn_dim)
    assert sizes.shape == (mc.num_experts,) and cot.shape == (lhs.shape[0], rhs.shape[2])
    assert lhs.shape[0] >= t * mc.top_k and lhs.shape[0] % mc.moe_tile == 0
    # The decode attention: the sampler's rows of a pass against the whole cache, no
    # cotangents (a forward only).
    q, k, v, mask, last = programs["decode_attention pallas_tpu fwd"]
    s = task.max_prompt_len + cfg.sampling.max_new_tokens
    assert k.shape == v.shape == (q.shape[0], mc.num_kv_heads, s, mc.head_dim)
    assert mask.shape == (q.shape[0], s) and last.shape == (q.shape[0],)


def test_table_rows_are_well_formed():
    for table in (LOGPROB_IMPLS, GMM_IMPLS, DECODE_IMPLS):
        for name, row in table.items():
            assert callable(row.load()), name
            if "target" in row.options:  # a Pallas kernel told to compile for a backend
                assert row.pallas and row.options["target"] in row.backends, name
            assert row.blocks is None or dataclasses.is_dataclass(row.blocks), name
    # The ops whose callers read a field of their own off a row.
    assert all(isinstance(row, GmmImpl) for row in GMM_IMPLS.values())
    assert all(isinstance(row, DecodeImpl) for row in DECODE_IMPLS.values())
    assert all(isinstance(row, LogprobImpl) for row in LOGPROB_IMPLS.values())


def _contract(example_args) -> list[str]:
    """The op's positional parameters: its example arguments, then its static keywords."""
    args, static = example_args
    return [a.name for a in args] + list(static)


# Each op: the stem of its modules (kernels/<op>.py, kernels/<op>_*.py), its table, and
# the parameters every implementation takes first.
OPS = (("fused_logprob", LOGPROB_IMPLS, _contract(logprob_example_args(8, 16, 32, "float32"))),
       ("gmm", GMM_IMPLS, _contract(gmm_example_args(8, CFG))),
       ("decode_attention", DECODE_IMPLS,
        _contract(decode_example_args(2, CFG, 16))[:5]))  # block, keys: keyword-only


def _implementations(op: str, contract: list[str]) -> dict[str, object]:
    """"module:function" -> function, for every public function of the op's modules (the
    table's aside) with the op's contract: its first parameters are `contract`, and
    any other without a default is keyword-only (a row binds it, e.g. `target`). The
    dispatcher, named after the op, is not an implementation; nor is a helper such as
    `fused_logprob_pallas.backward_pallas`, which takes more positional arguments."""
    found = {}
    src = pathlib.Path(kernels.__file__).parent
    for path in sorted([src / f"{op}.py", *src.glob(f"{op}_*.py")]):
        if path.stem == f"{op}_impls":
            continue
        module = importlib.import_module(f"stablerl_jax.kernels.{path.stem}")
        for attr, fn in vars(module).items():
            if attr.startswith("_") or attr == op or not callable(fn) or \
                    getattr(fn, "__module__", None) != module.__name__:
                continue
            params = list(inspect.signature(fn).parameters.values())
            rest = params[len(contract):]
            if [p.name for p in params[:len(contract)]] == contract and all(
                    p.default is not p.empty or p.kind is p.KEYWORD_ONLY for p in rest):
                found[f"{module.__name__}:{attr}"] = fn
    return found


@pytest.mark.parametrize("op, table, contract", OPS, ids=[op for op, _, _ in OPS])
def test_the_table_and_the_implementations_are_one_list(op, table, contract):
    """Every row runs a function of the op's modules named after it (the row's name, or
    `<function>_<target>` for a row binding a target), and every function of those modules
    with the op's contract is some row's: a row without its function, or an
    implementation without its row, fails here."""
    impls = _implementations(op, contract)
    for name, row in table.items():
        assert row.fn in impls, f"row {name!r}: {row.fn} is no {op} implementation"
        attr = row.fn.split(":")[1]
        assert name in (attr, f"{attr}_{row.options.get('target')}"), (
            f"row {name!r} runs {row.fn}: name the function after its row")
    unlisted = set(impls) - {row.fn for row in table.values()}
    assert not unlisted, f"{sorted(unlisted)}: implementations without a row of the table"
