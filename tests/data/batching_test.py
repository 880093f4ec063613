"""Prompt and SFT batches: shapes, padding side, groups, seeded epochs."""
import numpy as np
import pytest

from stablerl_jax.config import TaskConfig
from stablerl_jax.data import batching, sft_data, synthetic
from stablerl_jax.data.tokenizer import SentencePieceTokenizer

RECS = synthetic.generate(TaskConfig(num_train=50, num_test=5), "train")
TOK = SentencePieceTokenizer.train([r["prompt"] + " " + r["solution"] for r in RECS], 64)


def test_prompt_batch_left_padded_groups():
    tokens, mask, answers = batching.prompt_batch(RECS[:3], TOK, 4, 16)
    assert tokens.shape == (12, 16) and mask.shape == (12, 16)
    assert mask[:, -1].all()  # left padding: last slot always real
    for row in range(12):
        n = mask[row].sum()
        assert not mask[row, :16 - n].any() and (tokens[row, :16 - n] == TOK.pad_id).all()
        assert tokens[row, 16 - n] == TOK.bos_id
    np.testing.assert_array_equal(tokens[0], tokens[3])  # one group = 4 consecutive copies
    assert answers[:4] == [RECS[0]["answer"]] * 4 and answers[4] == RECS[1]["answer"]
    assert TOK.decode(tokens[4][mask[4]]) == RECS[1]["prompt"]
    b = batching.prompt_batch(RECS[:3], TOK, 4, 16)
    assert b.prompt_tokens_BxP.dtype == np.int32 and b.prompt_mask_BxP.dtype == bool


def test_too_long_prompt_or_solution_is_a_clear_error():
    with pytest.raises(ValueError, match="raise task.max_prompt_len"):
        batching.prompt_batch(RECS[:1], TOK, 1, 3)
    with pytest.raises(ValueError, match="group_size=0"):
        batching.prompt_batch(RECS[:1], TOK, 0, 16)


def test_sft_batch_masks_solution_only():
    # data/sft_data.py lays SFT rows out in the prompt batches' slots.
    enc = sft_data.Encoder(TaskConfig(), TOK)
    examples = [ex for r in RECS[:2] for ex in enc.encode(
        {"prompt": r["prompt"], "response": r["solution"]})]
    b = sft_data.sft_batch(examples, TOK.pad_id, 16, 40)
    t, attn = b.tokens_BxS, b.attn_BxS
    assert t.shape == (2, 57) and b.mask_BxT.shape == (2, 56)
    assert b.mask_BxT.dtype == np.float32
    # mask_BxT[:, t] marks the target tokens[:, t + 1]: solution + EOS only.
    loss = np.concatenate([np.zeros((2, 1), bool), b.mask_BxT > 0], axis=1)
    assert not loss[:, :16].any() and (loss <= attn).all()
    sol = t[0][loss[0]]
    assert sol[-1] == TOK.eos_id and TOK.decode(sol) == RECS[0]["solution"]
    # Prompt slots are laid out exactly as in a prompt batch; right padding after EOS.
    tokens, mask, _ = batching.prompt_batch(RECS[:2], TOK, 1, 16)
    np.testing.assert_array_equal(t[:, :16], tokens)
    np.testing.assert_array_equal(attn[:, :16], mask)
    n = loss[0].sum()
    assert attn[0, 16:16 + n].all() and not attn[0, 16 + n:].any()
    assert (t[0, 16 + n:] == TOK.pad_id).all()


def test_batch_indices_are_seeded_epochs():
    first = [batching.batch_indices(10, 4, s, seed=0) for s in range(5)]
    flat = np.concatenate(first)
    assert sorted(flat[:10]) == list(range(10))  # epoch 0 is a permutation
    np.testing.assert_array_equal(batching.batch_indices(10, 4, 3, seed=0), first[3])
    assert not np.array_equal(batching.batch_indices(10, 4, 0, seed=1), first[0])
    it = batching.epochs(RECS, 7, seed=0)
    assert [r["id"] for r in next(it)] == [RECS[i]["id"] for i in
                                          batching.batch_indices(50, 7, 0, 0)]
    # Every epoch is a permutation, reshuffled: 10 records, batches of 5 -> 2 per epoch.
    epochs = [np.concatenate([batching.batch_indices(10, 5, 2 * e + j, seed=3)
                              for j in range(2)]) for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    resumed = batching.epochs(RECS, 7, seed=0, start_step=5)
    assert [r["id"] for r in next(resumed)] == [RECS[i]["id"] for i in
                                               batching.batch_indices(50, 7, 5, 0)]
    with pytest.raises(ValueError, match="batch_size"):
        batching.batch_indices(0, 4, 0, 0)


def test_another_stream_is_its_own_seeded_epochs():
    # Stream 0 is the permutation of (seed, epoch) alone; another stream (the extra rounds
    # of dynamic sampling) is a different sequence of epochs, each still a permutation.
    np.testing.assert_array_equal(batching.epoch_order(10, 3, 1),
                                  np.random.default_rng([3, 1]).permutation(10))
    own = np.concatenate([batching.batch_indices(10, 5, s, seed=3) for s in range(2)])
    other = np.concatenate([batching.batch_indices(10, 5, s, seed=3, stream=2)
                            for s in range(2)])
    assert sorted(other) == list(range(10)) and not np.array_equal(own, other)
    np.testing.assert_array_equal(batching.batch_indices(10, 5, 1, seed=3, stream=2),
                                  other[5:])
