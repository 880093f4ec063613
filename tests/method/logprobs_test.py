"""Log-probs from hidden states (row invariance, temperature) and from tokens through the
model (`policy_logprobs`: the one frame shift of the training engine).

Letters: B batch, S slots, T = S − 1, D model, V vocab.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close, bound, engine_chain

from stablerl_jax.config import ModelConfig
from stablerl_jax.kernels.fused_logprob_impls import LogprobBlocks
from stablerl_jax.method.logprobs import policy_logprobs, token_logprobs
from stablerl_jax.model import transformer as tf

BLOCK = LogprobBlocks(chunk=16, tokens=16, vocab=16, vocab_tiles=2, dim=16, bwd_chunk=16,
                      bwd_tokens=16, bwd_vocab=16)
# The tests choose how Pallas runs: interpreted on a CPU, compiled for the accelerator.
INTERPRET = jax.default_backend() == "cpu"
PALLAS = "pallas_tpu" if jax.default_backend() == "tpu" else "pallas_gpu"


def _inputs(b=4, t=6, d=16, v=50, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (b, t, d), dtype),
            jax.random.normal(k[1], (d, v), dtype) * 0.5,
            jax.random.randint(k[2], (b, t), 0, v))


def _naive(h, w, y, temperature=1.0):
    z = jnp.einsum("btd,dv->btv", h, w, precision="highest") / temperature
    ls = jax.nn.log_softmax(z)
    return jnp.take_along_axis(ls, y[..., None], -1)[..., 0], -jnp.sum(jnp.exp(ls) * ls, -1)


@pytest.mark.parametrize("impl", ["chunked", PALLAS])
def test_row_does_not_depend_on_other_rows_bitwise(impl):
    h, w, y = _inputs()
    f = jax.jit(lambda h, w, y: token_logprobs(h, w, y, impl=impl, block=BLOCK,
                                               interpret=INTERPRET))
    logp, ent = f(h, w, y)
    other = h.at[1:].set(jax.random.normal(jax.random.key(9), h[1:].shape) * 10)
    logp2, ent2 = f(other, w, y)
    np.testing.assert_array_equal(logp2[0], logp[0])
    np.testing.assert_array_equal(ent2[0], ent[0])


def test_temperature_scales_logits_in_value_and_gradient(x64):
    # Algebra, not rounding: the chunked op with temperature against log_softmax(z / τ),
    # both in float64. n counts the logit dot (D = 16), the log-sum-exp and the entropy
    # sum over V = 50, and a few elementwise ops; gradients add the sum over B·T = 24.
    h, w, y = _inputs(dtype=jnp.float64)
    tau = 0.7
    logp, ent = token_logprobs(h, w, y, temperature=tau, block=BLOCK)
    want_logp, want_ent = _naive(h, w, y, tau)
    assert_close(logp, want_logp, n=16 + 2 * 50 + 8, dtype="float64", scale="max")
    assert_close(ent, want_ent, n=16 + 2 * 50 + 8, dtype="float64", scale="max")
    loss = lambda f: lambda h, w: sum(jnp.sum(o * c) for o, c in zip(f(h, w), (1.0, 0.3)))
    got = jax.grad(loss(lambda h, w: token_logprobs(h, w, y, temperature=tau, block=BLOCK)),
                   argnums=(0, 1))(h, w)
    want = jax.grad(loss(lambda h, w: _naive(h, w, y, tau)), argnums=(0, 1))(h, w)
    # The backward's sums (over B·T = 24 for ∂w, V = 50 for ∂h), with the cotangents'
    # rounding taken at each row's largest entry: Σ|terms| ≤ 9·max|∂| for these inputs.
    for g, wg in zip(got, want):
        assert_close(g, wg, n=2 * (16 + 2 * 50 + 8) + 24, dtype="float64", cond=10,
                     scale="max")


def test_policy_logprobs_shifts_the_frame_once():
    """logp[:, t] is the model's log-prob of tokens[:, t + 1] given tokens[:, :t + 1]:
    equal to the forward over the inputs and the fused op on the shifted targets, in the
    same compiled program order (bitwise)."""
    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=8, num_experts=4, top_k=2, expert_ffn_dim=16, max_seq_len=16,
                      moe_tile=4)
    params = tf.init_params(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, 32)
    attn = jnp.ones((3, 9), bool).at[0, :2].set(False)

    def by_hand(params):
        h, aux = tf.forward(params, tokens[:, :-1], cfg, attention_mask_BxT=attn[:, :-1])
        return token_logprobs(h, tf.unembed_matrix(params, cfg), tokens[:, 1:]), aux

    (want_logp, want_ent), want_aux = jax.jit(by_hand)(params)
    logp, ent, aux = jax.jit(lambda p: policy_logprobs(p, tokens, attn, cfg))(params)
    assert logp.shape == (3, 8) and aux["routes"].shape == (3, 8, 2, 2)
    np.testing.assert_array_equal(logp, want_logp)
    np.testing.assert_array_equal(ent, want_ent)
    np.testing.assert_array_equal(aux["routes"], want_aux["routes"])
    # Replaying the routes it just used reproduces it; other routes change it.
    replayed = jax.jit(lambda p, r: policy_logprobs(p, tokens, attn, cfg,
                                                    replay_BxTxLxK=r)[0])
    np.testing.assert_array_equal(replayed(params, aux["routes"]), logp)
    # Other routes move log-probs by more than any rounding of the whole float32 chain
    # (here ≈ 10× it).
    moved = float(jnp.abs(replayed(params, (aux["routes"] + 1) % 4) - logp).max())
    assert moved > bound(engine_chain(cfg, 9)) * float(jnp.abs(logp).max()), moved


def test_bad_arguments_name_the_value():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs(h, w, y, temperature=0)
    with pytest.raises(ValueError, match="targets_BxT.shape"):
        token_logprobs(h, w, y[:, :3])
    with pytest.raises(ValueError, match="impl='pallas'"):
        token_logprobs(h, w, y, impl="pallas")
