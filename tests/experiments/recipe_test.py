"""The `paper` recipe end to end, scaled down to CPU (marker `interop`: transformers and
torch build the checkpoint).

A tiny random Qwen3MoeForCausalLM is saved in bfloat16 with a Qwen-style tokenizer (chat
template, two stop ids in generation_config.json: tests/hf_fixtures.py), beside
MATH-format training data with boxed answers and two AIME-format eval sets named by
relative paths, as the preset names its own. `experiments.train --preset paper --hf`
trains two steps at lr 1e-6 and exports the policy. Then: the prompts carry the template;
a hand-made boxed completion earns reward 1 through the run's reward path; the sampler
stops on either stop id; truncated rows are masked out of the loss (rl.overlong=mask);
the float32 master weights moved; samples.jsonl and the per-set eval metrics exist; the
export is in the checkpoint's dtype.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import write_qwen3_moe, write_qwen_tokenizer

torch = pytest.importorskip("torch", reason="the interop extra (torch) is not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the interop extra (transformers) is not installed")

from experiments import train  # noqa: E402
from stablerl_jax import presets  # noqa: E402
from stablerl_jax.interop import hf_checkpoint as hc  # noqa: E402
from stablerl_jax.rl import loop  # noqa: E402
from stablerl_jax.rl.engine import Engine  # noqa: E402
from stablerl_jax.runs.checkpoint import Checkpointer  # noqa: E402
from stablerl_jax.runs.metrics_io import read_metrics  # noqa: E402
from stablerl_jax.sampling.rollout import Rollout  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.integration]  # each test reads the run
N_NEW = 8  # response budget: short, so that some responses are truncated

OVERRIDES = [
    "mesh=1,1,1", "model.compute_dtype=float32", "model.remat=none",
    "model.gmm_impl=tiles", "model.expert_parallel=false", "model.attention_impl=naive",
    "model.decode_attention_impl=blocks",
    "model.unroll_layers=true", "task.max_prompt_len=64", "task.max_solution_len=32",
    f"sampling.max_new_tokens={N_NEW}", "sampling.max_batch=0", "sampling.dispatch=dense",
    "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.microbatches=1",
    "rl.score_in_update=true", "rl.eval_every=2", "rl.eval_k=2", "rl.eval_problems=2",
    "rl.checkpoint_every=2",
    "rl.log_samples=2", "rl.eval_sets=aime24:aime24.jsonl,hmmt25:hmmt25.jsonl",
    "rl.optim.learning_rate=1e-6",
    # A random model earns no reward, so every group advantage and the policy gradient
    # are 0; a small router z-loss gives every weight below the last routers a gradient,
    # which is what the master weights' precision is tested with.
    "model.router_z_loss_weight=1e-3"]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    ckpt, data, work = root / "ckpt", root / "data", root / "run"
    ckpt.mkdir()
    data.mkdir()
    tok = write_qwen_tokenizer(ckpt)
    write_qwen3_moe(ckpt, tok)
    write_qwen_tokenizer(ckpt)  # save_pretrained wrote its own generation_config.json
    _write_jsonl(data / "train.jsonl", [
        {"problem": f"What is {a} + {b}?", "solution": f"{a} + {b} = {a + b}, so the "
         f"answer is $\\boxed{{{a + b}}}$.", "level": "Level 1", "type": "Algebra"}
        for a, b in [(3, 4), (12, 7), (2, 2), (5, 6)]])
    # Both sets (3 problems, capped at rl.eval_problems=2; and 1 problem, padded to 2)
    # sample k·2 = 4 rows, the training batch's size: one sampler program for all.
    _write_jsonl(data / "aime24.jsonl", [{"problem": f"Find {a} * 3.", "answer": str(3 * a)}
                                         for a in (1, 2, 3)])
    _write_jsonl(data / "hmmt25.jsonl", [{"problem": "Find x if 2x + 3 = 11.", "answer": "4"}])
    overrides = OVERRIDES + [f"task.jsonl_dir={data}"]
    summary = train.main(["--workdir", str(work), "--preset", "paper", "--hf", str(ckpt),
                               "--export-hf", str(root / "export"), "--quiet",
                               "--compile-cache=", *overrides])
    cfg = hc.experiment_with_checkpoint(presets.preset("paper", overrides), str(ckpt))
    stops = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    return {"root": root, "ckpt": str(ckpt), "work": str(work), "cfg": cfg, "stops": stops,
            "summary": summary, "data": loop.task_data(cfg, str(work))}


def test_prompts_carry_the_chat_template_and_a_boxed_answer_scores(run):
    data, cfg = run["data"], run["cfg"]
    assert cfg.task.chat_template and cfg.task.tokenizer_dir == run["ckpt"]
    prompt = data.train[0]["prompt"]
    assert prompt.startswith("<|im_start|>user\nWhat is") and "\\boxed{}" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # A hand-made completion through the run's reward path (tokens → decode → reward).
    rec = data.train[0]
    tokens, mask, answers = data.prompt_batch([rec], 2)
    texts = [f"<think>\nadd them</think>\nThe sum is \\boxed{{{rec['answer']}}}.<|im_end|>",
             "<think>\nthe answer is \\boxed{0} ... wait"]  # truncated inside <think>
    comp = [data.tokenizer.encode(t) for t in texts]
    width = max(map(len, comp))
    toks = np.concatenate([tokens, [c + [data.tokenizer.pad_id] * (width - len(c))
                                    for c in comp]], 1)
    cmask = np.concatenate([np.zeros_like(mask), [[i < len(c) for i in range(width)]
                                                   for c in comp]], 1)
    ro = Rollout(toks, np.concatenate([mask, np.zeros((2, width), bool)], 1), cmask,
                 cmask.sum(1), np.zeros(toks.shape, np.float32), None)
    np.testing.assert_array_equal(data.reward(ro, answers), [1.0, 0.0])


def test_the_sampler_stops_on_either_stop_id_and_truncated_rows_are_masked(run):
    cfg, data = run["cfg"], run["data"]
    tok = data.tokenizer
    assert tuple(tok.stop_ids) == run["stops"]  # <|im_end|> (eos) and <|endoftext|>
    eng = Engine.create(cfg, eos_id=tok.eos_id, pad_id=tok.pad_id, stop_ids=tok.stop_ids)
    params = hc.load_hf_params(run["ckpt"], cfg.model)
    tokens, mask, answers = data.prompt_batch(data.train[:2], cfg.rl.group_size)
    ended, masked = set(), 0
    for seed in range(8):  # the run's batch shape: its sampler program, drawn 8 times
        ro = jax.tree.map(np.asarray, eng.sample(params, tokens, mask, jax.random.key(seed)))
        last = ro.tokens_BxS[np.arange(len(tokens)), tokens.shape[1] + ro.lengths_B - 1]
        np.testing.assert_array_equal(ro.truncated_B, ~np.isin(last, tok.stop_ids))
        assert np.all(ro.lengths_B[ro.truncated_B] == N_NEW)
        ended |= set(last[~ro.truncated_B].tolist())
        if ro.truncated_B.any() and not masked:
            batch, _ = eng.score(params, ro, np.arange(len(tokens), dtype=np.float32) % 2)
            m = np.asarray(batch.mask_BxT)
            assert not m[ro.truncated_B].any()
            assert m[~ro.truncated_B].sum(1).tolist() == ro.lengths_B[~ro.truncated_B].tolist()
            masked += 1
    assert ended == set(tok.stop_ids), "rows should end on each of the two stop ids"
    assert masked, "some row should be truncated"


def test_float32_master_weights_moved_and_the_export_keeps_the_checkpoint_dtype(run):
    cfg = run["cfg"]
    assert cfg.model.param_dtype == "float32" and hc.checkpoint_dtype(run["ckpt"]) == "bfloat16"
    start = hc.load_hf_params(run["ckpt"], cfg.model)
    eng = Engine.create(cfg, eos_id=0, pad_id=0)
    state, meta = Checkpointer(f"{run['work']}/checkpoints").restore(
        None, eng.init_state(start)._asdict())
    assert meta["step"] == 2
    leaves = list(zip(jax.tree.leaves(start), jax.tree.leaves(state["params"])))
    assert all(b.dtype == jnp.float32 for _, b in leaves)
    changed = sum(int(np.sum(np.asarray(a) != np.asarray(b))) for a, b in leaves)
    # What bfloat16 weights would have kept of the same update: it rounds 1e-6 away.
    kept_in_bf16 = sum(int(np.sum(np.asarray(a) != np.asarray(b.astype(jnp.bfloat16),
                                                               np.float32)))
                       for a, b in leaves)
    total = sum(a.size for a, _ in leaves)
    assert changed > total // 3 and kept_in_bf16 < changed // 20, (changed, kept_in_bf16,
                                                                   total)
    exported = json.loads((run["root"] / "export" / "config.json").read_text())
    assert exported["torch_dtype"] == "bfloat16"


def test_metrics_samples_and_eval_sets(run):
    rows = read_metrics(run["work"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("response/truncated_frac", "response/length_mean", "response/length_max",
                "response/clip_ratio"):
        assert all(r[key] is not None for r in rows[1:]), key
    for s in ("aime24", "hmmt25"):
        for k in ("avg@k", "pass@k", "length_mean", "truncated_frac"):
            assert rows[2][f"eval/{s}/{k}"] is not None and rows[0][f"eval/{s}/{k}"] is not None
    assert rows[2]["eval/accuracy"] == pytest.approx(
        (rows[2]["eval/aime24/avg@k"] + rows[2]["eval/hmmt25/avg@k"]) / 2)
    assert run["summary"]["end_accuracy_by_set"] == {
        s: rows[2][f"eval/{s}/avg@k"] for s in ("aime24", "hmmt25")}
    samples = read_metrics(f"{run['work']}/samples.jsonl")
    assert {(s["step"], s["split"]) for s in samples} == {
        (st, sp) for st in (0, 2) for sp in ("eval/aime24", "eval/hmmt25")}
    assert all("<|im_start|>" not in s["prompt"] or "assistant" in s["prompt"]
               for s in samples)
    assert all("Please reason step by step" in s["prompt"] for s in samples)
    assert {"response", "ended", "reward", "truncated", "extractor",
            "answer"} <= set(samples[0])


def test_partial_rollouts_run_on_the_checkpoint_recipe(run, tmp_path):
    # The same checkpoint, tokenizer, chat template, two stop ids and MATH/AIME-shaped
    # data, sampled continuously over 2 slots with partial rollouts (S = 1): every step
    # trains on whole groups of the stream's prompts, within the bound.
    work = tmp_path / "partial"
    data = run["root"] / "data"
    train.main(["--workdir", str(work), "--preset", "paper", "--hf", run["ckpt"],
                     "--quiet", "--compile-cache=", *OVERRIDES, f"task.jsonl_dir={data}",
                     "rl.steps=3", "rl.checkpoint_every=3", "rl.eval_every=3",
                     "sampling.continuous=true", "sampling.max_batch=2",
                     "rl.max_staleness=1"])
    rows = read_metrics(str(work))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert 0 <= r["async/staleness_max"] <= 1 and r["async/dropped"] >= 0
        assert np.isfinite(r["kl/train_infer_k1"])
    comp = read_metrics(f"{work}/minibatches.jsonl")
    assert all(len(c["prompts"]) == 2 for c in comp)
    assert rows[3]["eval/aime24/avg@k"] is not None


def test_packed_score_and_update_run_on_the_checkpoint_recipe(run, tmp_path):
    # The same recipe with token-budget packing (rl.pack_tokens): rows of 144 tokens hold
    # two 72-token sequences; the step trains and its monitors are finite.
    work = tmp_path / "packed"
    train.main(["--workdir", str(work), "--preset", "paper", "--hf", run["ckpt"],
                     "--quiet", "--compile-cache=", *OVERRIDES,
                     f"task.jsonl_dir={run['root'] / 'data'}", "rl.steps=1",
                     "rl.checkpoint_every=1", "rl.eval_every=1", "rl.pack_tokens=144",
                     "rl.pack_rows=1"])
    rows = read_metrics(str(work))
    assert [r["step"] for r in rows] == [0, 1]
    assert np.isfinite(rows[1]["kl/train_infer_k1"]) and np.isfinite(rows[1]["entropy"])
    assert rows[1]["skipped_updates"] == 0


# What only fits this recipe to a CPU test's seconds: the batch, lengths and eval sets cut.
SCALE = ["task.max_prompt_len=64", "task.max_solution_len=32", f"sampling.max_new_tokens={N_NEW}",
         "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.microbatches=1",
         "rl.eval_every=1", "rl.eval_k=2", "rl.eval_problems=2", "rl.checkpoint_every=1",
         "rl.eval_sets=aime24:aime24.jsonl,hmmt25:hmmt25.jsonl"]


def test_the_paper_recipe_runs_on_this_cpu_with_no_layout_override(run, tmp_path, capsys):
    """`--preset paper --hf DIR` with the recipe only cut in scale: the preflight finds
    that the v5p-256 layout does not run here, says so in one line, and runs the recipe
    single-host (bf16 compute, full remat, chunked attention: the preset's) with the
    kernels that compile on a CPU."""
    from stablerl_jax.config import flat_dict
    work = tmp_path / "here"
    summary = train.main(["--workdir", str(work), "--preset", "paper", "--hf", run["ckpt"],
                          "--quiet", "--compile-cache=", *SCALE,
                          f"task.jsonl_dir={run['root'] / 'data'}"])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layout:")]
    # 8 CPU devices here (tests/conftest.py); the 4 rows of a step split over 4.
    assert len(said) == 1 and "running it single-host on 4 cpu device(s)" in said[0]
    assert summary["steps"] == 1 and summary["skipped_updates"] == 0
    rows = read_metrics(str(work))
    assert np.isfinite(rows[1]["kl/train_infer_k1"]) and rows[1]["eval/aime24/avg@k"] is not None
    ckpt = Checkpointer(str(work / "checkpoints"))
    try:
        stored = ckpt.read_meta(1)["config"]
    finally:
        ckpt.close()
    expect = flat_dict(presets.preset("paper", [*SCALE, f"task.jsonl_dir={run['root'] / 'data'}"],
                                      layout="single-host", devices=4))
    assert {k: stored[k] for k in ("mesh", "model.gmm_impl", "model.decode_attention_impl",
                                   "model.compute_dtype", "model.remat", "sampling.max_batch")} \
        == {k: expect[k] for k in ("mesh", "model.gmm_impl", "model.decode_attention_impl",
                                   "model.compute_dtype", "model.remat", "sampling.max_batch")}
    assert stored["model.compute_dtype"] == "bfloat16" and stored["model.remat"] == "full"
    # --layout preset keeps the pod layout, and is refused here in one line.
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(tmp_path / "pod"), "--preset", "paper", "--layout",
                    "preset", "--hf", run["ckpt"], "--quiet", "--compile-cache=", *SCALE,
                    f"task.jsonl_dir={run['root'] / 'data'}"])
    assert e.value.code == 2 and "mesh" in capsys.readouterr().err
    assert not (tmp_path / "pod").exists()
