"""The data front door: load_split dispatches on the task kind and reads array_record
through the TFDS data source (no TensorFlow); TaskData trains the tokenizer once with the
model's vocab_size and hands out typed SFT batches."""
import sys

import numpy as np

from stablerl_jax.config import TaskConfig
from stablerl_jax.data import synthetic
from stablerl_jax.data.task import TaskData, load_split

SMALL = TaskConfig(num_train=200, num_test=40)


def test_load_split_reads_through_data_source_without_tensorflow(tmp_path):
    a = load_split(SMALL, "train", str(tmp_path))
    b = load_split(SMALL, "train", str(tmp_path))  # reuses the built files
    assert a == b == synthetic.generate(SMALL, "train")  # sorted by id = generation order
    assert load_split(SMALL, "test", str(tmp_path)) == synthetic.generate(SMALL, "test")
    assert set(a[0]) == {"id", "prompt", "solution", "answer"}
    assert list(tmp_path.glob("arithmetic/*/1.0.0/*.array_record*"))
    assert "tensorflow" not in sys.modules


def test_task_data_tokenizer_and_batches(tmp_path):
    data = TaskData.create(SMALL, 48, str(tmp_path))
    assert data.tokenizer.vocab_size <= 48  # the model's vocab_size bounds the tokenizer
    assert (tmp_path / "spm_arithmetic_48_4_1.model").exists()
    again = TaskData.create(SMALL, 48, str(tmp_path))  # reuses splits and tokenizer
    assert again.tokenizer.model_proto == data.tokenizer.model_proto
    batch = next(data.sft_batches(4, seed=0))
    assert batch.tokens_BxS.shape[0] == 4
    assert batch.mask_BxT.shape == (4, batch.tokens_BxS.shape[1] - 1)
    tokens, mask, answers = data.prompt_batch(data.train[:2], group_size=3)
    assert tokens.shape[0] == 6 and answers[:3] == [data.train[0]["answer"]] * 3
    np.testing.assert_array_equal(data.train_indices(0, 4, seed=1),
                                  data.train_indices(0, 4, seed=1))
