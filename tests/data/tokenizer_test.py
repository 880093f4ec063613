"""SentencePiece trained in-process: round trip, special ids, the raw decode that shows
them, reuse."""
import pytest

from stablerl_jax import presets
from stablerl_jax.config import TaskConfig
from stablerl_jax.data import synthetic
from stablerl_jax.data.tokenizer import SentencePieceTokenizer

CORPUS = [r["prompt"] + " " + r["solution"]
          for r in synthetic.generate(TaskConfig(num_train=300, num_test=10), "train")]


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


def test_the_raw_decode_shows_control_ids_as_their_pieces(tmp_path):
    tok = SentencePieceTokenizer.load_or_train(str(tmp_path / "t.model"), CORPUS, 64)
    assert [tok.sp.id_to_piece(i) for i in (0, 2, 3)] == ["<pad>", "<s>", "</s>"]
    for text in CORPUS[:20]:
        assert tok.decode_raw(tok.encode(text)) == text
    ids = [2] + tok.encode("1+2=") + [0] + tok.encode("3") + [3]
    assert tok.decode_raw(ids) == "<s>1+2=<pad>3</s>"
    assert tok.decode(ids) == "1+2=3"
    # Out-of-range ids decode as unk, as in `decode`.
    one = tok.encode("1")
    assert tok.decode_raw(one + [999, 3]) == tok.decode(one + [999]) + "</s>"


def test_saved_model_is_reused(tmp_path):
    path = str(tmp_path / "t.model")
    a = SentencePieceTokenizer.load_or_train(path, CORPUS, 64)
    # A few lines would train a different (smaller) model; the saved one must win.
    assert SentencePieceTokenizer.train(CORPUS[:3], 64).model_proto != a.model_proto
    b = SentencePieceTokenizer.load_or_train(path, CORPUS[:3], 64)
    assert a.model_proto == b.model_proto


def test_round_trip_on_every_preset_and_style():
    for name, task in presets.TASKS.items():
        recs = [r for style in synthetic.styles(task)
                for r in synthetic.generate(task.replace(num_train=100, style=style), "train")]
        texts = [r["prompt"] + " " + r["solution"] for r in recs]
        tok = SentencePieceTokenizer.train(texts, presets.tiny().model.vocab_size)
        for r in recs:
            for text in (r["prompt"], r["solution"]):
                assert tok.decode(tok.encode(text)) == text, (name, text)
        assert all(len(tok.encode(d)) == 1 for d in "0123456789")


def test_a_saved_model_that_does_not_cover_the_corpus_is_refused(tmp_path):
    path = str(tmp_path / "t.model")
    SentencePieceTokenizer.load_or_train(path, CORPUS, 64)
    with pytest.raises(ValueError, match="does not cover the corpus"):
        SentencePieceTokenizer.load_or_train(path, ["1+2 (mod 100)="], 64)


def test_a_saved_model_larger_than_vocab_size_is_refused(tmp_path):
    path = str(tmp_path / "t.model")
    tok = SentencePieceTokenizer.load_or_train(path, CORPUS, 64)
    with pytest.raises(ValueError, match="raise vocab_size"):
        SentencePieceTokenizer.load_or_train(path, CORPUS, tok.vocab_size - 1)
