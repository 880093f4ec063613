"""The two-stage recipe from a checkpoint (marker `interop`: transformers and torch build
it): a tiny random Qwen3MoeForCausalLM with a Qwen-style tokenizer and chat template
(tests/hf_fixtures.py), cold-started by `experiments.train --preset paper --hf DIR
--sft-only` on chat-format reasoning traces (`messages`, system prompts, a two-turn
chat, one trace too long for the budget), then RL from the export.

Checked: the over-long trace is dropped and counted at load; the assistant-token loss
falls; the batch's trained targets are the assistant turns through `<|im_end|>`, target
by target against transformers' rendering; the SFT-only run evaluates the eval set with
the RL sampler and writes samples that show their stop token; the export carries the template and both stop ids, loads in
transformers and gives the cold-started policy's logits; an RL run starts from it.
`--sft-only` with no SFT steps is refused.
"""
import contextlib
import io
import json

import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import write_jsonl, write_recipe_dirs
from tolerance import LAMBDA, assert_close, forward_chain

torch = pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the interop extra (transformers) is not installed")

from experiments import train  # noqa: E402
from stablerl_jax import presets  # noqa: E402
from stablerl_jax.data import sft_data  # noqa: E402
from stablerl_jax.interop import hf_checkpoint as hc  # noqa: E402
from stablerl_jax.model import transformer as tf  # noqa: E402
from stablerl_jax.rl import loop  # noqa: E402
from stablerl_jax.runs.checkpoint import load_params  # noqa: E402
from stablerl_jax.runs.metrics_io import read_metrics  # noqa: E402

pytestmark = pytest.mark.interop

BASE = ["mesh=1,1,1", "model.compute_dtype=float32", "model.remat=none",
        "model.gmm_impl=tiles", "model.expert_parallel=false", "model.attention_impl=naive",
        "model.decode_attention_impl=blocks",
        "model.unroll_layers=true", "task.max_prompt_len=64", "task.max_solution_len=48",
        "sampling.max_new_tokens=16", "sampling.max_batch=0", "sampling.dispatch=dense",
        "rl.prompts_per_step=2", "rl.group_size=2", "rl.microbatches=1",
        "rl.score_in_update=true", "rl.eval_k=2", "rl.eval_problems=2", "rl.log_samples=2",
        "rl.checkpoint_every=1", "rl.eval_sets=aime24:aime24.jsonl"]
SFT = ["sft.steps=40", "sft.batch_size=4", "sft.checkpoint_every=20",
       "sft.optim.learning_rate=3e-3", "sft.optim.warmup_frac=0.0"]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def _trace(a, b):
    return (f"<think>\n{a} + {b} = {a + b}\n</think>\n\n"
            f"The answer is $\\boxed{{{a + b}}}$.")


def _chats():
    turn = lambda a, b: [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": _trace(a, b)}]
    chats = [{"messages": [SYSTEM, *turn(a, b)]} for a, b in [(3, 4), (12, 7), (2, 2)]]
    chats.append({"messages": turn(5, 6) + turn(1, 8)})  # two turns: both trained
    long = {"role": "assistant", "content": "<think>\n" + "9 + 9 = 18. " * 20 + "</think>"}
    chats.append({"messages": turn(9, 9)[:1] + [long]})  # over task.max_solution_len
    return chats


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("coldstart")
    ckpt, data, tok = write_recipe_dirs(root)
    sft_file = write_jsonl(root / "sft.jsonl", _chats())
    over = [*BASE, f"task.jsonl_dir={data}"]
    export = root / "export"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train.main(["--workdir", str(root / "sft_only"), "--preset", "paper",
                                   "--hf", str(ckpt), "--sft-only", "--export-hf",
                                   str(export), "--export-dtype", "float32", "--quiet",
                                   "--compile-cache=", *over, *SFT, f"sft.data={sft_file}"])
    cfg = hc.experiment_with_checkpoint(presets.preset("paper", over), str(ckpt))
    return {"root": root, "ckpt": ckpt, "export": export, "over": over, "cfg": cfg,
            "summary": summary, "tok": tok, "printed": out.getvalue(), "sft_file": sft_file}


@pytest.mark.integration
def test_the_cold_start_filters_at_load_and_lowers_the_loss(stages):
    # 3 one-turn chats, the two-turn chat as one example per turn (the template drops
    # the first turn's thinking once a later user message follows), the long trace.
    assert ("read as 'messages': 6 examples, 5 kept (0 with a prompt over "
            "task.max_prompt_len=64 tokens, 1 with a response over") in stages["printed"]
    rows = read_metrics(str(stages["root"] / "sft_only" / "sft_run"))
    assert [r["step"] for r in rows] == list(range(1, 41))
    first, last = rows[0]["sft/loss"], np.mean([r["sft/loss"] for r in rows[-5:]])
    assert last < 0.5 * first, (first, last)
    settings = json.loads((stages["root"] / "sft_only" / "sft.json").read_text())
    assert settings["init"] == str(stages["ckpt"]) and settings["sft.data"].endswith("sft.jsonl")


@pytest.mark.integration
def test_the_trained_targets_are_the_assistant_turns_as_transformers_renders_them(stages):
    # The batch the cold start trains on, target by target: tokens[:, t + 1] carries loss
    # where mask_BxT[:, t] = 1. Its trained text must be each assistant turn through the
    # template's <|im_end|>, its untrained text the generation prompt before it.
    hf = transformers.AutoTokenizer.from_pretrained(str(stages["ckpt"]))
    expected = []
    for chat in _chats()[:-1]:  # the last trace is over the budget (dropped at load)
        msgs = chat["messages"]
        for i in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
            gen = hf.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
            upto = hf.apply_chat_template(msgs[:i + 1], tokenize=False)
            expected.append((gen, upto[len(gen):].rstrip("\n")))
    cfg = presets.preset("paper", [*stages["over"], *SFT, f"sft.data={stages['sft_file']}"])
    cfg = hc.experiment_with_checkpoint(cfg, str(stages["ckpt"]))
    with contextlib.redirect_stdout(io.StringIO()):
        data = loop.task_data(cfg, str(stages["root"] / "sft_only"))
        examples = sft_data.load(cfg, data).examples
    batch = sft_data.sft_batch(examples, data.tokenizer.pad_id, cfg.task.max_prompt_len,
                               cfg.task.max_solution_len)
    raw = lambda ids: data.tokenizer.tok.decode([int(i) for i in ids],
                                                skip_special_tokens=False)
    got = []
    for tokens, attn, mask in zip(batch.tokens_BxS, batch.attn_BxS, batch.mask_BxT > 0):
        first = int(np.argmax(mask)) + 1  # the first trained token
        got.append((raw(tokens[:first][attn[:first]]), raw(tokens[1:][mask])))
        assert not (mask & ~attn[1:]).any()  # no loss on padding
        assert np.ptp(np.flatnonzero(mask)) + 1 == mask.sum()  # one contiguous trained span
    assert [t for _, t in got] == [t for _, t in expected]
    assert [g for g, _ in got] == [g for g, _ in expected]


@pytest.mark.integration
def test_the_sft_only_run_evaluates_and_logs_samples_with_their_stop(stages):
    work = stages["root"] / "sft_only"
    rows = read_metrics(str(work))
    assert [r["step"] for r in rows] == [0] and stages["summary"]["steps"] == 0
    for k in ("avg@k", "pass@k", "length_mean", "truncated_frac"):
        assert rows[0][f"eval/aime24/{k}"] is not None
    samples = read_metrics(str(work / "samples.jsonl"))
    assert samples and all(s["split"] == "eval/aime24" for s in samples)
    for s in samples:
        assert s["ended"] in ("<|im_end|>", "<|endoftext|>", "truncated")
        assert s["ended"] == "truncated" or s["response"].endswith(s["ended"])
        assert s["prompt"].startswith("<|im_start|>user\nWhat is")


@pytest.mark.integration
def test_the_export_loads_in_transformers_with_its_template_and_logits(stages):
    export, ckpt = str(stages["export"]), str(stages["ckpt"])
    source = transformers.AutoTokenizer.from_pretrained(ckpt)
    exported = transformers.AutoTokenizer.from_pretrained(export)
    chat = _chats()[0]["messages"]
    text = exported.apply_chat_template(chat, tokenize=False)
    assert text == source.apply_chat_template(chat, tokenize=False)
    stops = [stages["tok"].token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")]
    assert transformers.GenerationConfig.from_pretrained(export).eos_token_id == stops
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    ids = np.asarray([exported(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.numpy()[0]
    cfg = stages["cfg"].model
    params = load_params(str(stages["root"] / "sft_only" / "sft"))
    hidden, _ = tf.forward(params, jnp.asarray(ids), cfg)
    logits = np.asarray(tf.logits(params, hidden, cfg))[0]
    # As tests/interop/hf_parity_test.py: two float32 evaluations of the same function.
    assert_close(logits, ref, n=forward_chain(cfg, ids.shape[1]) + cfg.d_model, lam=LAMBDA,
                 scale="max")
    base = transformers.AutoModelForCausalLM.from_pretrained(ckpt).float().eval()
    with torch.no_grad():
        before = base(input_ids=torch.tensor(ids)).logits.numpy()[0]
    assert np.abs(before - ref).max() > 1.0  # the export is the tuned policy


@pytest.mark.integration
def test_rl_starts_from_the_export(stages, tmp_path):
    summary = train.main(["--workdir", str(tmp_path), "--preset", "paper", "--hf",
                               str(stages["export"]), "--quiet", "--compile-cache=",
                               *stages["over"], "rl.steps=1", "rl.eval_every=1"])
    assert summary["steps"] == 1
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1] and np.isfinite(rows[1]["kl/train_infer_k1"])


def test_sft_only_without_sft_steps_is_a_one_line_error(tmp_path, capsys):
    # The paper preset trains no cold start (sft.steps=0): --sft-only would evaluate and
    # export the base checkpoint unchanged, so it is refused before anything is written.
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(tmp_path / "w"), "--preset", "paper", "--sft-only"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--sft-only: sft.steps is 0 (preset 'paper'), so there is no cold "
                        "start to train; give sft.steps=N with N > 0")
    assert not (tmp_path / "w").exists()
