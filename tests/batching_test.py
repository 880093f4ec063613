"""Prompt and SFT batches: shapes, padding side, groups, seeded epochs."""
import numpy as np

from stablerl_jax.data import batching, synthetic
from stablerl_jax.data.tokenizer import SentencePieceTokenizer

RECS = synthetic.generate(synthetic.TaskConfig(num_train=50, num_test=5), "train")
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


def test_sft_batch_masks_solution_only():
    b = batching.sft_batch(RECS[:2], TOK, 16, 40)
    t, loss, attn = b["tokens_BxT"], b["loss_mask_BxT"], b["attn_BxT"]
    assert t.shape == (2, 57)
    assert not loss[:, :16].any() and (loss <= attn).all()
    sol = t[0][loss[0]]
    assert sol[-1] == TOK.eos_id and TOK.decode(sol) == RECS[0]["solution"]


def test_batch_indices_are_seeded_epochs():
    first = [batching.batch_indices(10, 4, s, seed=0) for s in range(5)]
    flat = np.concatenate(first)
    assert sorted(flat[:10]) == list(range(10))  # epoch 0 is a permutation
    np.testing.assert_array_equal(batching.batch_indices(10, 4, 3, seed=0), first[3])
    assert not np.array_equal(batching.batch_indices(10, 4, 0, seed=1), first[0])
    it = batching.epochs(RECS, 7, seed=0)
    assert [r["id"] for r in next(it)] == [RECS[i]["id"] for i in
                                          batching.batch_indices(50, 7, 0, 0)]
