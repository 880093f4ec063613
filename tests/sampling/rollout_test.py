"""The sampling path: exactness of the 'exact' preset, slot alignment of logp_mu and
routes_mu, EOS handling, keys, batch and padding invariance, truncation, bad inputs, KV
cache layouts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cpu_devices
from tolerance import LAMBDA, assert_close, engine_chain

from stablerl_jax import sharding
from stablerl_jax.config import ConfigError, ModelConfig, SamplingConfig
from stablerl_jax.method.logprobs import policy_logprobs
from stablerl_jax.model import moe
from stablerl_jax.model import numerics as nx
from stablerl_jax.model import transformer as tf
from stablerl_jax.sampling import rollout as ro

# Same config, prompts and sampling as tests/method/mismatch_test.py, so a shared process
# compiles the sampler once.
CFG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, expert_ffn_dim=64, max_seq_len=40,
                  moe_tile=16)
SAMPLING = SamplingConfig(max_new_tokens=20)
EOS, PAD = 2, 0
B, P = 16, 12
S = P + SAMPLING.max_new_tokens


def assert_same_logp(actual, desired):
    """Cached decode and the full-sequence forward of the `exact` engine differ only in
    float32 summation order: within the probabilistic bound of a log-prob's chain
    (tests/tolerance.py), relative to the largest log-prob."""
    assert_close(actual, desired, n=engine_chain(CFG, S), lam=LAMBDA, scale="max")


@functools.lru_cache(maxsize=None)
def _setup():
    params = tf.init_params(jax.random.key(0), CFG)
    prompts = jax.random.randint(jax.random.key(1), (B, P), 3, CFG.vocab_size)
    pad = (jnp.arange(B) % 4) * 3  # left padding of 0, 3, 6, 9 slots
    mask = jnp.arange(P)[None, :] >= pad[:, None]
    return params, jnp.where(mask, prompts, 0), mask


@functools.lru_cache(maxsize=None)
def _rollout(seed=2, preset="exact"):
    params, prompts, mask = _setup()
    return ro.sample(params, prompts, mask, jax.random.key(seed), CFG, SAMPLING,
                     nx.numerics_preset(preset), eos_id=EOS, pad_id=PAD)


def test_exact_preset_matches_training_path():
    params, _, _ = _setup()
    r = _rollout()
    attn = r.prompt_mask_BxS | r.completion_mask_BxS
    logp_pi_BxT, _, aux = jax.jit(policy_logprobs, static_argnames="cfg")(
        params, r.tokens_BxS, attn, cfg=CFG)
    comp = np.asarray(r.completion_mask_BxS[:, 1:])
    assert comp.sum() > 0
    # Slot s + 1's token is scored from hidden[s]: logp_mu[:, 1:] against logp_pi.
    assert_same_logp(np.where(comp, logp_pi_BxT, 0), r.logp_mu_BxS[:, 1:])
    # Routes of the input slots (the last slot is never fed back, so never recorded).
    routes_mu = np.asarray(r.routes_mu_BxSxLxK)
    assert (routes_mu[:, -1] == -1).all()
    rec = routes_mu[:, :-1] >= 0
    assert rec.sum() > 0
    np.testing.assert_array_equal(np.where(rec, aux["routes"], -1), routes_mu[:, :-1])


@pytest.mark.parametrize("on_mesh", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kv_cache_layouts_sample_the_same_rows(on_mesh):
    # The head-major cache ('bksd') changes where the sampler keeps keys and values, not
    # what it computes: the same tokens, log μ, routes and weights bit for bit as 'bskd',
    # with the FP8 engine's bfloat16 cache, on one device and on a 2×2×2 mesh of CPU
    # devices (experts under shard_map, the batch sharded).
    params, prompts, mask = _setup()
    mesh = sharding.make_mesh(2, 2, 2, devices=cpu_devices()) if on_mesh else None
    if mesh is not None:
        params = jax.device_put(params, sharding.replicated(mesh))
        prompts, mask = jax.device_put((prompts, mask), sharding.batch_sharding(mesh))
    out = [ro.sample(params, prompts, mask, jax.random.key(4), CFG.replace(kv_cache_layout=lay),
                     SAMPLING, nx.numerics_preset("fp8"), eos_id=EOS, pad_id=PAD, mesh=mesh)
           for lay in ("bskd", "bksd")]
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_routes_mu_is_aligned_and_a_valid_replay():
    _, prompts, mask = _setup()
    r = _rollout()
    routes = np.asarray(r.routes_mu_BxSxLxK)
    rec_BxS = (routes >= 0).all(axis=(2, 3))
    # Recorded exactly on real prompt tokens and fed-back completion tokens: every
    # completion token except the row's last one (EOS or the N-th token).
    comp = np.asarray(r.completion_mask_BxS)
    last = np.zeros_like(comp)
    last[np.arange(B), P + np.asarray(r.lengths_B) - 1] = True
    np.testing.assert_array_equal(rec_BxS, np.asarray(r.prompt_mask_BxS) | (comp & ~last))
    np.testing.assert_array_equal(r.prompt_mask_BxS[:, :P], mask)
    np.testing.assert_array_equal(r.tokens_BxS[:, :P], prompts)
    assert routes.dtype == np.int32
    # The combine weights of those experts: 0 where nothing was recorded, else K weights
    # summing to 1 (norm_topk_prob; float32: K − 1 additions after the ÷ by the sum).
    weights = np.asarray(r.route_weights_mu_BxSxLxK)
    assert (weights[routes < 0] == 0).all() and (weights[routes >= 0] > 0).all()
    assert_close(weights.sum(-1)[rec_BxS], 1.0, n=CFG.top_k + 1)
    # Raises on partial rows, duplicates or out-of-range experts.
    moe.validate_replay(r.routes_mu_BxSxLxK, (B, S, CFG.num_layers), CFG.top_k,
                        CFG.num_experts)


def test_eos_rows_stop_and_are_masked():
    r = _rollout()
    comp = np.asarray(r.completion_mask_BxS)
    toks = np.asarray(r.tokens_BxS)
    logp = np.asarray(r.logp_mu_BxS)
    stopped = 0
    for b in range(B):
        eos = np.nonzero(toks[b, P:] == EOS)[0]
        n = int(r.lengths_B[b])
        if len(eos):
            stopped += 1
            assert n == eos[0] + 1  # EOS is the last completion token, and counted
            assert (toks[b, P + n:] == PAD).all()
        else:
            assert n == SAMPLING.max_new_tokens
        assert comp[b, P:P + n].all() and not comp[b, P + n:].any() and not comp[b, :P].any()
        assert (logp[b, :P] == 0).all() and (logp[b, P + n:] == 0).all()
        assert (logp[b, P:P + n] < 0).all()
    assert 0 < stopped < B, "fixture should hold both EOS-terminated and full-length rows"


def test_keys_determine_samples():
    a = _rollout(2)
    params, prompts, mask = _setup()
    again = ro.sample(params, prompts, mask, jax.random.key(2), CFG, SAMPLING,
                      nx.numerics_preset("exact"), eos_id=EOS, pad_id=PAD)
    for x, y in zip(a, again):
        np.testing.assert_array_equal(x, y)
    c = _rollout(3)
    assert not np.array_equal(a.tokens_BxS, c.tokens_BxS)
    # A raw uint32 key (jax.random.PRNGKey) gives the same row keys as its typed form.
    typed = jax.random.key_data(ro.row_keys(jax.random.key(2), B))
    raw = jax.random.key_data(ro.row_keys(jax.random.key_data(jax.random.key(2)), B))
    np.testing.assert_array_equal(raw, typed)


def test_rows_are_batch_and_padding_invariant():
    # One key splits into per-row keys, so passing those row keys to a different batch
    # must reproduce each row. Rows 3, 7, 11, 15 carry 9 slots of left padding in the
    # 16-row batch; alone they form a 4-row batch with no padding at all.
    params, prompts, _ = _setup()
    r = _rollout()
    rows = np.arange(3, B, 4)
    keys = jax.random.split(jax.random.key(2), B)[rows]
    short = prompts[rows, 9:]
    alone = ro.sample(params, short, jnp.ones_like(short, bool), keys, CFG, SAMPLING,
                      nx.numerics_preset("exact"), eos_id=EOS, pad_id=PAD)
    np.testing.assert_array_equal(alone.tokens_BxS[:, 3:], r.tokens_BxS[rows, P:])
    np.testing.assert_array_equal(alone.lengths_B, r.lengths_B[rows])
    assert_same_logp(alone.logp_mu_BxS[:, 3:], r.logp_mu_BxS[rows, P:])
    np.testing.assert_array_equal(alone.routes_mu_BxSxLxK[:, 3:],
                                  r.routes_mu_BxSxLxK[rows, P:])
    np.testing.assert_array_equal(alone.routes_mu_BxSxLxK[:, :3],
                                  r.routes_mu_BxSxLxK[rows, 9:P])


def test_truncation_support():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    # float32 log of the constants (2 roundings), /temperature, log-softmax over V = 4
    # (4 + 2), exp (1): n = 10; excluded tokens are exactly 0.
    close = lambda lp, want: assert_close(jnp.exp(lp), np.asarray(want, np.float64), n=10)
    close(ro.sampling_logprobs(logits, SamplingConfig(top_k=2)), [[0.625, 0.375, 0, 0]])
    # 0.5 + 0.3 reaches 0.8
    close(ro.sampling_logprobs(logits, SamplingConfig(top_p=0.8)), [[0.625, 0.375, 0, 0]])
    # 0.81 needs the third
    close(ro.sampling_logprobs(logits, SamplingConfig(top_p=0.81)),
          np.array([[0.5, 0.3, 0.15, 0]]) / 0.95)
    close(ro.sampling_logprobs(logits, SamplingConfig(top_k=3, top_p=0.5)), [[1, 0, 0, 0]])
    close(ro.sampling_logprobs(logits, SamplingConfig(temperature=0.5)),
          np.array([[0.5, 0.3, 0.15, 0.05]]) ** 2 / (0.25 + 0.09 + 0.0225 + 0.0025))
    # k ≥ V: no truncation
    close(ro.sampling_logprobs(logits, SamplingConfig(top_k=10)), [[0.5, 0.3, 0.15, 0.05]])


def test_invalid_inputs_name_the_field():
    params, prompts, mask = _setup()
    exact = nx.numerics_preset("exact")
    sample = lambda p, m, key=jax.random.key(0), sampling=SAMPLING, eos=EOS, pad=PAD: ro.sample(
        params, p, m, key, CFG, sampling, exact, eos_id=eos, pad_id=pad)
    with pytest.raises(ValueError, match="max_seq_len=40"):
        sample(prompts, mask, sampling=SamplingConfig(max_new_tokens=29))
    for field, kw in [("max_new_tokens", {"max_new_tokens": 0}),
                      ("temperature", {"temperature": 0.0}),
                      ("temperature", {"temperature": -1.0}),
                      ("top_k", {"top_k": -1}), ("top_p", {"top_p": 0.0}),
                      ("top_p", {"top_p": 1.5}), ("numerics", {"numerics": "train"}),
                      ("router_noise_std", {"router_noise_std": float("inf")})]:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            SamplingConfig(**kw)
    with pytest.raises(ValueError, match="unknown 'fp4'"):
        nx.numerics_preset("fp4")
    with pytest.raises(ValueError, match="left-padded"):
        sample(prompts, mask[:, ::-1])
    with pytest.raises(ValueError, match="at least one real"):
        sample(prompts, mask & False)
    with pytest.raises(ValueError, match="^pad_id=64"):
        sample(prompts, mask, pad=64)
    for eos in (-2, 64):  # -1 is allowed: no EOS, every row decodes max_new_tokens
        with pytest.raises(ValueError, match=f"^eos_id={eos}"):
            sample(prompts, mask, eos=eos)
    with pytest.raises(ValueError, match="^key:"):
        sample(prompts, mask, key=jax.random.split(jax.random.key(0), 3))
    with pytest.raises(ValueError, match="^prompt_tokens:"):
        sample(prompts.astype(jnp.float32), mask)


def test_any_stop_id_ends_a_row():
    # A second stop id X: a token some rows emit before EOS. Row keys fix each row's draws,
    # so with stop set {EOS, X} every row is the EOS-only rollout cut after its first EOS
    # or X: mask, lengths, log-probs and routes follow the first stop id.
    params, prompts, mask = _setup()
    r1 = _rollout()
    toks1 = np.asarray(r1.tokens_BxS)
    comp1 = np.asarray(r1.completion_mask_BxS)
    # The most frequent completion token that occurs before an EOS: it ends some rows early.
    before_eos = np.concatenate([toks1[b, P:P + int(r1.lengths_B[b]) - 1] for b in range(B)])
    x = int(np.bincount(before_eos[before_eos != EOS]).argmax())
    r2 = ro.sample(params, prompts, mask, jax.random.key(2), CFG, SAMPLING,
                   nx.numerics_preset("exact"), eos_id=EOS, pad_id=PAD, stop_ids=(x,))
    shortened = 0
    for b in range(B):
        n1 = int(r1.lengths_B[b])
        hits = np.nonzero(np.isin(toks1[b, P:P + n1], (EOS, x)))[0]
        n2 = int(hits[0]) + 1 if len(hits) else SAMPLING.max_new_tokens
        shortened += n2 < n1
        assert int(r2.lengths_B[b]) == n2, b
        end = P + n2
        np.testing.assert_array_equal(r2.tokens_BxS[b, :end], toks1[b, :end])
        assert (np.asarray(r2.tokens_BxS[b, end:]) == PAD).all()
        np.testing.assert_array_equal(r2.completion_mask_BxS[b, :end], comp1[b, :end])
        assert not np.asarray(r2.completion_mask_BxS[b, end:]).any()
        np.testing.assert_array_equal(r2.logp_mu_BxS[b, :end], r1.logp_mu_BxS[b, :end])
        assert (np.asarray(r2.logp_mu_BxS[b, end:]) == 0).all()
        # Routes as recorded up to the stop token, which is never fed back (-1 from it on).
        np.testing.assert_array_equal(r2.routes_mu_BxSxLxK[b, :end - 1],
                                      r1.routes_mu_BxSxLxK[b, :end - 1])
        assert (np.asarray(r2.routes_mu_BxSxLxK[b, end - 1:]) == -1).all()
        assert bool(r2.truncated_B[b]) == (not len(hits)), b
    assert shortened > 0, "X should end some rows before their EOS"
    np.testing.assert_array_equal(
        r2.truncated_B, ro.truncated_rows(r2.tokens_BxS, r2.completion_mask_BxS, (EOS, x),
                                          SAMPLING.max_new_tokens))


def test_a_model_forced_to_emit_a_second_stop_id_stops_there():
    # Unembedding columns 5 = +1e5·e_0 and 6 = −1e5·e_0, all others 0: every step one of
    # 5 / 6 has logit 1e5·|ĥ_0| > 0 and takes all the mass. With stop ids {EOS, 5, 6}
    # every row stops on its first token (length 1, not truncated, no route recorded in
    # the completion); with EOS alone the same model never stops and every row is
    # truncated at max_new_tokens.
    params, prompts, mask = _setup()
    col = jnp.zeros((CFG.d_model,)).at[0].set(1e5)
    unembed = jnp.zeros_like(params["unembed"]).at[:, 5].set(col).at[:, 6].set(-col)
    forced = dict(params, unembed=unembed)
    n = SAMPLING.max_new_tokens
    for stop_ids, length in (((5, 6), 1), ((), n)):
        r = ro.sample(forced, prompts, mask, jax.random.key(3), CFG, SAMPLING,
                      nx.numerics_preset("exact"), eos_id=EOS, pad_id=PAD, stop_ids=stop_ids)
        np.testing.assert_array_equal(r.lengths_B, length)
        np.testing.assert_array_equal(r.truncated_B, length == n)
        assert np.isin(np.asarray(r.tokens_BxS[:, P:P + length]), (5, 6)).all()
        assert (np.asarray(r.tokens_BxS[:, P + length:]) == PAD).all()
        assert (np.asarray(r.routes_mu_BxSxLxK[:, P + length - 1:]) == -1).all()
