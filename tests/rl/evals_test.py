"""Eval sets: any problem count (the batch padded to the mesh / sampler multiple, the
padding rows dropped), per-set numbers and their means, decoded sample rows (special
tokens shown, the stop token that ended each row or "truncated")."""
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from hf_fixtures import write_qwen_tokenizer

from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.rl import evals
from stablerl_jax.sampling.rollout import Rollout


@pytest.mark.parametrize("n, k, multiple, processes, want", [
    (30, 32, 128, 1, 32),   # AIME on the paper's mesh: 30·32 = 960 rows → 32·32 = 1,024
    (30, 4, 128, 1, 32),
    (3, 2, 8, 1, 4),
    (5, 1, 1, 2, 6),        # two processes hold equal blocks of problems
    (8, 4, 8, 1, 8),        # already a multiple: no padding
])
def test_padded_problems(n, k, multiple, processes, want):
    got = evals.padded_problems(n, k, multiple, processes)
    assert got == want and got * k % multiple == 0 and got % processes == 0


class _Data:
    """The TaskData calls evaluate_set makes, on prompts that are one token each: the
    problem's id. A completion is [id, id + 1, …] of length 1 + id, truncated when it
    reaches 4 tokens; it is correct when its first sampled token is the answer."""

    class tokenizer:  # noqa: N801 - the TaskData attribute
        @staticmethod
        def decode(ids):
            return " ".join(str(int(i)) for i in ids)

        decode_raw = decode

    def prompt_batch(self, records, k):
        tokens = np.repeat([[int(r["prompt"])] for r in records], k, axis=0).astype(np.int32)
        return tokens, np.ones_like(tokens, bool), [r["answer"] for r in records for _ in
                                                     range(k)]

    def completions(self, rollout):
        return [self.tokenizer.decode(t[c]) for t, c in
                zip(np.asarray(rollout.tokens_BxS), np.asarray(rollout.completion_mask_BxS))]

    def reward_with_source(self, rollout, answers):
        first = [c.split()[0] for c in self.completions(rollout)]
        return (np.float32([f == a for f, a in zip(first, answers)]),
                ["boxed"] * len(answers))


def _sample(seen):
    def sample(tokens_BxP, mask_BxP, key):
        seen.append(len(tokens_BxP))
        ids_B = tokens_BxP[:, 0]
        n = 4
        comp_BxN = np.arange(n)[None, :] < np.minimum(ids_B[:, None] + 1, n)
        toks_BxN = np.where(comp_BxN, ids_B[:, None] + np.arange(n)[None, :], 0)
        lengths_B = comp_BxN.sum(1).astype(np.int32)
        b = len(ids_B)
        return Rollout(np.concatenate([tokens_BxP, toks_BxN], 1).astype(np.int32),
                       np.concatenate([mask_BxP, np.zeros_like(comp_BxN)], 1),
                       np.concatenate([np.zeros_like(mask_BxP), comp_BxN], 1), lengths_B,
                       np.zeros((b, 1 + n), np.float32), np.full((b, 1 + n, 1, 1), -1),
                       truncated_B=lengths_B >= n)
    return sample


def test_an_eval_set_of_any_size_is_padded_and_the_padding_dropped():
    # Problems 0..2 with answers 0, 5, 2: problems 0 and 2 are right (first token = id),
    # lengths 1, 2, 3 (no truncation); the padded batch has 4·2 = 8 rows.
    recs = [{"prompt": str(i), "answer": a} for i, a in enumerate(["0", "5", "2"])]
    seen = []
    summary, _ = evals.evaluate_set(_sample(seen), _Data(), recs, jax.random.key(0), 2, 8)
    assert seen == [8]
    assert summary["avg@k"] == pytest.approx(2 / 3) and summary["pass@k"] == pytest.approx(2 / 3)
    assert summary["length_mean"] == pytest.approx(2.0) and summary["truncated_frac"] == 0.0


def test_sets_report_each_and_their_mean_and_sample_rows():
    sets = {"a": [{"prompt": "0", "answer": "0"}, {"prompt": "1", "answer": "9"}],
            "b": [{"prompt": "3", "answer": "3"}]}  # id 3: four tokens, truncated
    metrics, samples = evals.evaluate_sets(_sample([]), _Data(), sets, jax.random.key(0),
                                           num_problems=64, k=2, multiple=4, log_samples=1)
    assert metrics["eval/a/avg@k"] == 0.5 and metrics["eval/b/avg@k"] == 1.0
    assert metrics["eval/a/length_mean"] == 1.5 and metrics["eval/b/length_mean"] == 4.0
    assert metrics["eval/a/truncated_frac"] == 0.0 and metrics["eval/b/truncated_frac"] == 1.0
    assert metrics["eval/accuracy"] == 0.75 and metrics["eval/pass_at_k"] == 0.75
    assert metrics["eval/truncated_frac"] == 0.5 and metrics["eval/length_mean"] == 2.75
    # Standard errors over problems: set a's per-problem means 1, 0 (std 0.5 over 2
    # problems), set b's one problem 0; the mean of the two sets has sqrt(Σ se²) / 2.
    assert metrics["eval/a/stderr"] == pytest.approx(0.5 / 2**0.5)
    assert metrics["eval/b/stderr"] == 0.0
    assert metrics["eval/accuracy_stderr"] == pytest.approx(0.5 / 2**0.5 / 2)
    assert [s["split"] for s in samples] == ["eval/a", "eval/b"]
    assert samples[1] == {"split": "eval/b", "prompt": "3", "response": "3 4 5 6",
                          "ended": "truncated", "answer": "3", "reward": 1.0,
                          "extractor": "boxed", "length": 4, "truncated": True}
    assert samples[0]["ended"] == "0" and samples[0]["response"] == "0"  # its last token


def test_a_sample_shows_its_special_tokens_and_which_stop_id_ended_it(tmp_path):
    # Qwen3's tokenizer: two stop ids, <|im_end|> (eos) and <|endoftext|> (also pad).
    write_qwen_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(str(tmp_path))
    im_end, endoftext = tok.stop_ids
    prompt = "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    texts = ["The answer is \\boxed{19}.<|im_end|>", "#### 42<|endoftext|>",
             "Let's think step by step"]  # no stop id: truncated
    comp = [tok.encode(t) for t in texts]
    assert comp[0][-1] == im_end and comp[1][-1] == endoftext
    width = max(map(len, comp)) + 2  # every row padded with pad = <|endoftext|>
    p_ids = tok.encode(prompt)
    toks_BxS = np.array([p_ids + c + [tok.pad_id] * (width - len(c)) for c in comp])
    cmask_BxS = np.array([[False] * len(p_ids) + [i < len(c) for i in range(width)]
                          for c in comp])
    pmask_BxS = np.zeros_like(cmask_BxS)
    pmask_BxS[:, :len(p_ids)] = True
    lengths_B = cmask_BxS.sum(1)
    ro = Rollout(toks_BxS, pmask_BxS, cmask_BxS, lengths_B, np.zeros(toks_BxS.shape),
                 None, truncated_B=np.array([False, False, True]))
    rows = evals.sample_rows(SimpleNamespace(tokenizer=tok), toks_BxS[:, :len(p_ids)],
                             pmask_BxS[:, :len(p_ids)], ro, np.float32([1, 0, 0]),
                             ["19", "19", "19"], ["boxed", "none", "none"], 8, "train")
    assert [r["ended"] for r in rows] == ["<|im_end|>", "<|endoftext|>", "truncated"]
    assert [r["response"] for r in rows] == texts  # the padding after a row is not shown
    assert all(r["prompt"] == prompt for r in rows)
    assert [r["length"] for r in rows] == [len(c) for c in comp]
    assert [r["truncated"] for r in rows] == [False, False, True]
