"""External engines' routes and offline rollout files: a hand-built vLLM-style batch maps
to the replay tensor slot by slot; malformed recordings are refused naming the field; our
own sampler's rollouts survive the file round trip exactly, and the trainer scores them
as it scores the live rollout."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rl_helpers import EOS_ID, PAD_ID, responses_from_rollout, tiny_cfg

from stablerl_jax.interop.rollouts import OfflineRollouts, engine_routes_to_replay, write_rollouts
from stablerl_jax.model import transformer as tf
from stablerl_jax.rl.engine import Engine
from stablerl_jax.sampling.rollout import truncated_rows

E = 8


def _routed():
    """Two responses, L = 2, K = 2, right-padded to M = 5 recorded tokens:
    r0: prompt 2 + completion 3 → 4 processed tokens; r1: prompt 4 + completion 1 → 4.
    Token i of row r holds experts (i, i + 1) + r in layer 0 and + 2 more in layer 1; the
    padding holds -7, which must never be read."""
    routed = np.full((2, 5, 2, 2), -7, np.int16)  # vLLM returns int16
    for r in range(2):
        for i in range(4):
            routed[r, i, 0] = [i + r, i + r + 1]
            routed[r, i, 1] = [i + r + 2, i + r + 3]
    return routed


def test_engine_routes_land_in_our_slots():
    routed = _routed()
    routes, weights = engine_routes_to_replay(routed, [2, 4], [3, 1], max_prompt_len=4,
                                              max_new_tokens=3, num_layers=2,
                                              top_k=2, num_experts=E)
    want = np.full((2, 7, 2, 2), -1, np.int32)
    # r0: prompt in slots 2, 3; completion tokens 1, 2 (slots 4, 5) were processed; the
    # last sampled token (slot 6) never was.
    want[0, [2, 3, 4, 5]] = routed[0, :4]
    # r1: prompt fills slots 0..3; its only sampled token (slot 4) was never processed.
    want[1, [0, 1, 2, 3]] = routed[1, :4]
    np.testing.assert_array_equal(routes, want)
    assert routes.dtype == np.int32 and weights is None
    w = np.arange(routed.size, dtype=np.float32).reshape(routed.shape)
    _, weights = engine_routes_to_replay(routed, [2, 4], [3, 1], max_prompt_len=4,
                                         max_new_tokens=3, num_layers=2, top_k=2,
                                         num_experts=E, weights_BxTexLxK=w)
    np.testing.assert_array_equal(weights[0, 2:6], w[0, :4])
    assert (weights[want < 0] == 0).all()


@pytest.mark.parametrize("change,message", [
    (lambda a: (a[0][:, :, :1], a[1], a[2]), "routed_experts: shape"),
    (lambda a: (a[0].astype(np.float32), a[1], a[2]), "must be integer"),
    (lambda a: (a[0][:, :3], a[1], a[2]), "row 0 needs 4 recorded tokens"),
    (lambda a: (a[0], [2, 5], a[2]), "prompt_lens: must be in"),
    (lambda a: (a[0], [2], a[2]), "prompt_lens / completion_lens: shapes"),
    (lambda a: (a[0], a[1], [3, 4]), "completion_lens: must be in"),
    (lambda a: (np.where(a[0] == 3, 8, a[0]), a[1], a[2]), "outside \\[0, num_experts=8\\)"),
    (lambda a: (np.where(a[0] == 2, 1, a[0]), a[1], a[2]), "repeats an expert"),
])
def test_malformed_recordings_are_refused_naming_the_field(change, message):
    routed, p, c = change((_routed(), [2, 4], [3, 1]))
    with pytest.raises(ValueError, match=message):
        engine_routes_to_replay(routed, p, c, max_prompt_len=4, max_new_tokens=3,
                                num_layers=2, top_k=2, num_experts=E)


@functools.lru_cache(maxsize=None)
def _sampled():
    cfg = tiny_cfg(replay="r3", replay_weights=True)
    params = tf.init_params(jax.random.key(0), cfg.model)
    b, p = 8, cfg.task.max_prompt_len
    prompts = jax.random.randint(jax.random.key(1), (b, p), 4, 60)
    mask = jnp.ones((b, p), bool).at[:3, :5].set(False)
    eng = Engine.create(cfg, eos_id=EOS_ID, pad_id=PAD_ID)
    ro = eng.sample(params, jnp.where(mask, prompts, PAD_ID), mask, jax.random.key(2))
    return cfg, params, eng, jax.tree.map(np.asarray, ro)


def test_our_rollouts_survive_the_file_round_trip_and_score_the_same(tmp_path):
    cfg, params, eng, ro = _sampled()
    rewards = np.arange(8, dtype=np.float32) % 2
    path = str(tmp_path / "rollouts.npz")
    write_rollouts(path, responses_from_rollout(ro, rewards), group_size=2)
    off = OfflineRollouts.load(path)
    off.check(group_size=2, responses_per_step=8, steps=1, num_layers=2, top_k=2,
              need_routes=True, need_weights=True)
    back, r, answers = off.batch(np.arange(8), max_prompt_len=cfg.task.max_prompt_len,
                                 max_new_tokens=cfg.sampling.max_new_tokens, pad_id=PAD_ID,
                                 num_layers=2, top_k=2, num_experts=8)
    for name, a, b in zip(ro._fields, ro, back):
        if name != "truncated_B":  # a file holds no stop ids: the loop derives the flag
            np.testing.assert_array_equal(b, a, err_msg=name)
    assert back.truncated_B is None and 0 < ro.truncated_B.sum() < 8
    np.testing.assert_array_equal(
        truncated_rows(back.tokens_BxS, back.completion_mask_BxS, (EOS_ID,),
                       cfg.sampling.max_new_tokens), ro.truncated_B)
    np.testing.assert_array_equal(r, rewards)
    assert answers is None
    # The same arrays through the same jitted score step: the same batch.
    b0, _ = eng.score(params, ro, rewards)
    b1, _ = eng.score(params, back, r)
    jax.tree.map(np.testing.assert_array_equal, b1, b0)


def test_files_that_cannot_feed_the_run_are_refused(tmp_path):
    cfg, params, eng, ro = _sampled()
    recs = responses_from_rollout(ro, np.zeros(8))
    path = str(tmp_path / "r.npz")
    write_rollouts(path, [{k: v for k, v in r.items() if k != "route_weights"}
                          for r in recs], group_size=2)
    off = OfflineRollouts.load(path)
    kw = dict(group_size=2, responses_per_step=8, steps=1, num_layers=2, top_k=2,
              need_routes=True, need_weights=False)
    off.check(**kw)
    for change, message in [({"group_size": 4}, "rl.group_size=4"),
                            ({"steps": 2}, "lower rl.steps to 1"),
                            ({"need_weights": True}, "rl.replay_weights"),
                            ({"num_layers": 3}, "num_layers=3")]:
        with pytest.raises(ValueError, match=message):
            off.check(**{**kw, **change})
    np.savez(path, prompt_ids=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="missing field"):
        OfflineRollouts.load(path)
    write_rollouts(path, recs, group_size=2)
    arrays = dict(np.load(path))
    arrays["logp_mu"] = arrays["logp_mu"][:-1]
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="logp_mu has"):
        OfflineRollouts.load(path)


def test_answers_must_be_strings_or_integers(tmp_path):
    # str() of a bytes answer is "b'5'", which no response matches: refused; integers
    # read as their decimal strings.
    recs = [{"prompt_ids": [5, 6], "completion_ids": [7], "logp_mu": [-1.0], "answer": i}
            for i in range(4)]
    path = tmp_path / "r.npz"
    write_rollouts(str(path), recs, group_size=2)
    arrays = dict(np.load(path))
    np.savez(path, **{**arrays, "answers": np.arange(4)})
    off = OfflineRollouts.load(str(path))
    assert off.batch([0, 3], max_prompt_len=4, max_new_tokens=2, pad_id=PAD_ID,
                     num_layers=2, top_k=2, num_experts=E)[2] == ["0", "3"]
    np.savez(path, **{**arrays, "answers": arrays["answers"].astype("S")})
    with pytest.raises(ValueError, match=r"r.npz: field 'answers' has dtype \|S1; it must "
                                         r"hold str or integers"):
        OfflineRollouts.load(str(path))
