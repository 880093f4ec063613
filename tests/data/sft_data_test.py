"""Cold-start data (data/sft_data.py): formats, the loss mask checked token by token
against transformers' rendering of the chat template, multi-turn chats, the load-time
filter and its counts."""
import json
import types

import numpy as np
import pytest
from hf_fixtures import CHATML_TEMPLATE, QWEN3_CHAT_TEMPLATE, write_qwen_tokenizer

from stablerl_jax.config import TaskConfig
from stablerl_jax.data import sft_data
from stablerl_jax.data.chat_template import ChatTemplate
from stablerl_jax.data.hf_tokenizer import HFTokenizer
from stablerl_jax.data.tokenizer import SentencePieceTokenizer


TRACE = "<think>\nAdd 3 and 4: 3 + 4 = 7.\n</think>\n\nThe sum is $\\boxed{7}$."
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": TRACE},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "<think>\n2 + 2 = 4\n</think>\n\n\\boxed{4}"}]


@pytest.fixture(scope="module", params=["qwen3", "chatml"])
def tokdir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_qwen_tokenizer(path, chat_template=CHATML_TEMPLATE if request.param == "chatml"
                         else QWEN3_CHAT_TEMPLATE)
    return request.param, path


def _encoder(path, **task):
    task = TaskConfig(kind="jsonl", jsonl_dir="d", chat_template=True,
                      tokenizer_dir=str(path), **task)
    tok = HFTokenizer.from_dir(str(path))
    return sft_data.Encoder(task, tok, ChatTemplate.from_dir(str(path))), tok


def _hf(path):
    """transformers' tokenizer of `path`: the reference rendering of its template."""
    transformers = pytest.importorskip(
        "transformers", reason="the interop extra (transformers) is not installed")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))


def _raw(tok, ids):
    return tok.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def test_only_assistant_tokens_up_to_the_stop_token_are_trained(tokdir):
    kind, path = tokdir
    enc, tok = _encoder(path)
    hf = _hf(path)
    [ex] = enc.encode({"messages": CHAT[:3]})
    gen = hf.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    full = hf.apply_chat_template(CHAT[:3], tokenize=False)
    # The context is the generation prompt, token for token as RL tokenizes a prompt.
    assert ex.prompt.tolist() == tok.encode(gen)
    # The trained tokens are the turn as the template writes it, up to <|im_end|>.
    turn = full[len(gen):full.rindex("<|im_end|>") + len("<|im_end|>")]
    assert ex.trained.all() and ex.response.tolist() == tok.encode(turn)
    assert ex.response[-1] == tok.eos_id and _raw(tok, ex.response).endswith("<|im_end|>")
    assert "<think>\nAdd 3 and 4" in _raw(tok, ex.response)  # the thinking is trained
    assert _raw(tok, np.concatenate([ex.prompt, ex.response])) == full.rstrip("\n")


def test_every_assistant_turn_of_a_chat_is_trained_the_rest_masked(tokdir):
    kind, path = tokdir
    enc, tok = _encoder(path)
    hf = _hf(path)
    examples = enc.encode({"messages": CHAT})
    turns = [2, 4]
    if kind == "chatml":  # renders turns as written: one sequence, two trained spans
        [ex] = examples
        full = hf.apply_chat_template(CHAT, tokenize=False)
        ids = np.concatenate([ex.prompt, ex.response])
        trained = np.concatenate([np.zeros(len(ex.prompt), bool), ex.trained])
        assert _raw(tok, ids) == full.rstrip("\n")
        spans = np.flatnonzero(np.diff(np.concatenate([[0], trained.astype(int), [0]])))
        texts = [_raw(tok, ids[a:b]) for a, b in zip(spans[::2], spans[1::2])]
        assert texts == [CHAT[i]["content"] + "<|im_end|>" for i in turns]
        assert _raw(tok, ids[~trained]).count("And 2 + 2?") == 1  # the user turn: context
    else:  # Qwen3 drops earlier turns' thinking: one example per turn
        assert len(examples) == 2
        for ex, i in zip(examples, turns):
            gen = hf.apply_chat_template(CHAT[:i], tokenize=False, add_generation_prompt=True)
            upto = hf.apply_chat_template(CHAT[:i + 1], tokenize=False)
            assert ex.prompt.tolist() == tok.encode(gen) and ex.trained.all()
            assert _raw(tok, ex.response) == upto[len(gen):].rstrip("\n")
        assert "Add 3 and 4" not in _raw(tok, examples[1].prompt)  # as the template has it


def test_a_generation_prompt_the_turn_does_not_start_with_is_refused(tmp_path):
    write_qwen_tokenizer(tmp_path)
    enc, tok = _encoder(tmp_path, enable_thinking=False)
    with pytest.raises(ValueError, match="task.enable_thinking=false"):
        enc.encode({"prompt": "What is 3 + 4?", "response": TRACE})
    # A response without thinking follows the empty think block: trained after it.
    [ex] = enc.encode({"prompt": "What is 3 + 4?", "response": "\\boxed{7}"})
    assert _raw(tok, ex.prompt).endswith("<think>\n\n</think>\n\n")
    assert _raw(tok, ex.response) == "\\boxed{7}<|im_end|>"


def test_without_a_template_prompt_then_response_and_eos(tmp_path):
    tok = SentencePieceTokenizer.train(["What is 3 + 4? 3 + 4 = 7"] * 20, 40)
    task = TaskConfig(prompt_template="Q: {question}")
    enc = sft_data.Encoder(task, tok)
    [ex] = enc.encode({"prompt": "3 + 4", "response": "7"})
    assert ex.prompt.tolist() == [tok.bos_id] + tok.encode("Q: 3 + 4")
    assert ex.response.tolist() == tok.encode("7") + [tok.eos_id] and ex.trained.all()
    with pytest.raises(ValueError, match="task.chat_template=true"):
        enc.encode({"messages": CHAT[1:3]})
    batch = sft_data.sft_batch([ex], tok.pad_id, 8, 4)
    assert batch.tokens_BxS.shape == (1, 13)
    np.testing.assert_array_equal(batch.tokens_BxS[0, 8 - len(ex.prompt):8], ex.prompt)
    # mask_BxT[t] marks the target tokens[t + 1]: the response and EOS only.
    assert np.flatnonzero(batch.mask_BxT[0]).tolist() == [7 + k for k in range(len(ex.response))]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _data(tok, train=()):
    return types.SimpleNamespace(tokenizer=tok, train=list(train),
                                 cfg=TaskConfig(kind="jsonl", jsonl_dir="d"))


def _cfg(path, **task):
    from stablerl_jax import presets
    over = [f"task.{k}={v}" for k, v in task.items()]
    return presets.preset("tiny", ["task.kind=jsonl", "task.jsonl_dir=d", "task.chat_template=true",
                                   f"task.tokenizer_dir={path}", "model.max_seq_len=256",
                                   *over])


def test_load_filters_over_long_prompts_and_responses_and_counts_them(tmp_path, capsys):
    write_qwen_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(str(tmp_path))
    user = lambda q: {"role": "user", "content": q}
    reply = lambda a: {"role": "assistant", "content": a}
    rows = [{"messages": CHAT[1:3]},
            {"messages": [user("What is 1 + 1?"), reply("\\boxed{2}")]},
            {"messages": [user("x" * 400), reply("\\boxed{2}")]},             # prompt too long
            {"messages": [user("What is 2 + 2?"), reply("It is $\\boxed{4}$. " * 30)]}]
    file = _write(tmp_path / "sft.jsonl", rows)
    cfg = _cfg(tmp_path, max_prompt_len=48, max_solution_len=60).replace(
        sft=_cfg(tmp_path).sft.replace(data=file))
    out = sft_data.load(cfg, _data(tok))
    assert len(out.examples) == 2 and out.dropped == {"prompt": 1, "response": 1}
    assert out.format == "messages"
    assert "4 examples, 2 kept (1 with a prompt over" in capsys.readouterr().out
    # The task's own training split (sft.data=''): an over-long worked solution is
    # dropped and counted at load, not an error at the step that meets it.
    train = [{"prompt": "p", "question": "What is 2 + 2?", "solution": s}
             for s in ("$\\boxed{4}$", "It is $\\boxed{4}$. " * 30)]
    own = sft_data.load(cfg.replace(sft=cfg.sft.replace(data="")), _data(tok, train))
    assert len(own.examples) == 1 and own.dropped == {"prompt": 0, "response": 1}
    tight = cfg.replace(task=cfg.task.replace(max_solution_len=2))
    with pytest.raises(ValueError, match=r"sft.jsonl: none of the 4 cold-start examples fits"):
        sft_data.load(tight, _data(tok))


def test_formats_are_detected_and_bad_records_named(tmp_path):
    write_qwen_tokenizer(tmp_path)
    tok = HFTokenizer.from_dir(str(tmp_path))
    base = _cfg(tmp_path, max_prompt_len=64, max_solution_len=64)
    load = lambda rows, **sft: sft_data.load(base.replace(sft=base.sft.replace(
        data=_write(tmp_path / "s.jsonl", rows), **sft)), _data(tok))
    assert load([{"prompt": "1 + 1?", "response": "2"}]).format == "prompt_response"
    assert load([{"problem": "1 + 1?", "solution": "$\\boxed{2}$"}]).format == "math"
    gsm = load([{"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}])
    assert gsm.format == "gsm8k"
    with pytest.raises(ValueError, match=r"s.jsonl:1: .*no cold-start format fits the fields "
                                         r"\['text'\]"):
        load([{"text": "hello"}])
    with pytest.raises(ValueError, match=r"s.jsonl:2: malformed record .*no assistant turn"):
        load([{"messages": CHAT[1:3]}, {"messages": CHAT[:2]}])
    with pytest.raises(ValueError, match=r"s.jsonl:1: malformed .*list of \{'role'"):
        load([{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"s.jsonl:2: malformed"):
        load([{"messages": CHAT[1:3]}, "{not json"])
    skipping = base.replace(task=base.task.replace(skip_malformed=True))
    out = sft_data.load(skipping.replace(sft=skipping.sft.replace(data=_write(
        tmp_path / "k.jsonl", [{"messages": CHAT[1:3]}, "{not json"]))), _data(tok))
    assert out.skipped == 1 and len(out.examples) == 1
    # The task's own split: records without a worked solution cannot be trained on.
    with pytest.raises(ValueError, match="no worked solutions to train on; name cold-start "
                                         "data with sft.data"):
        sft_data.load(base, _data(tok, [{"prompt": "p", "question": "q", "solution": ""}]))
    with pytest.raises(FileNotFoundError, match="sft.data: .*nope.jsonl: no such file"):
        sft_data.load(base.replace(sft=base.sft.replace(data=str(tmp_path / "nope.jsonl"))),
                      _data(tok))
