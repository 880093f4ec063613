"""SentencePiece trained in-process: round trip, special ids, reuse."""
from stablerl_jax.data import synthetic
from stablerl_jax.data.tokenizer import SentencePieceTokenizer

CORPUS = [r["prompt"] + " " + r["solution"]
          for r in synthetic.generate(synthetic.TaskConfig(num_train=300, num_test=10), "train")]


def test_round_trip_and_special_ids(tmp_path):
    tok = SentencePieceTokenizer.load_or_train(str(tmp_path / "t.model"), CORPUS, 64)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    assert tok.vocab_size <= 64
    for text in CORPUS[:20] + ["12-7=5 #### -30"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert not {0, 2, 3} & set(ids)
    # Digits are single pieces.
    assert len(tok.encode("123")) == 3
    # Specials and out-of-range ids (a larger model vocab) never break decoding.
    assert tok.decode([2] + tok.encode("1+2=") + [3, 0, 999]) .startswith("1+2=")


def test_saved_model_is_reused(tmp_path):
    path = str(tmp_path / "t.model")
    a = SentencePieceTokenizer.load_or_train(path, CORPUS, 64)
    b = SentencePieceTokenizer.load_or_train(path, ["completely different text"], 64)
    assert a.model_proto == b.model_proto
