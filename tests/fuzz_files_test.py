"""Property-based fuzzing of the files a run reads: a Hugging Face checkpoint's
config.json, shard index and tokenizer.json, an offline rollout file, and data records
in JSONL and parquet files (math problems, cold-start chats). The property, the profiles
and where a finding goes are tests/fuzz_test.py's (tests/fuzz_helpers.py)."""
from __future__ import annotations

import io
import json
import math
import os
import shutil
import zipfile

import numpy as np
import pytest
from fuzz_helpers import (
    HF_CFG,
    JSON,
    PROFILES,
    REFUSED,
    SCALARS,
    damaged_bytes,
    json_bytes,
    mutated_json_object,
    pass_over_open,
    run,
    works_or_user_error,
    write_tiny_checkpoint,
)
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stablerl_jax.config import is_int
from stablerl_jax.data import jsonl, sft_data
from stablerl_jax.interop import hf_checkpoint, rollouts

# -- a Hugging Face checkpoint: config.json and the shard index -----------------------

# config.json key -> (ModelConfig field, JSON type the key must hold to be read)
HF_FIELDS = {"vocab_size": ("vocab_size", int), "hidden_size": ("d_model", int),
             "num_hidden_layers": ("num_layers", int),
             "num_attention_heads": ("num_heads", int),
             "num_key_value_heads": ("num_kv_heads", int), "head_dim": ("head_dim", int),
             "num_experts": ("num_experts", int), "num_experts_per_tok": ("top_k", int),
             "moe_intermediate_size": ("expert_ffn_dim", int),
             "max_position_embeddings": ("max_seq_len", int),
             "rms_norm_eps": ("norm_eps", float), "rope_theta": ("rope_theta", float),
             "norm_topk_prob": ("norm_topk_prob", bool),
             "tie_word_embeddings": ("tie_embeddings", bool)}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny valid checkpoint directory: (its path, config.json, the index)."""
    path = str(tmp_path_factory.mktemp("hf"))
    return (path,) + write_tiny_checkpoint(path, HF_CFG)


def _checkpoint_dir(base: str, config: bytes, index: bytes | None) -> str:
    """A checkpoint directory beside `base`, made afresh, with `base`'s weights (linked),
    `config` as config.json and `index` as the shard index (None: no index)."""
    path = base + "-fuzzed"
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    for name in os.listdir(base):
        if name.endswith(".safetensors"):
            os.symlink(os.path.join(base, name), os.path.join(path, name))
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.write(config)
    if index is not None:
        with open(os.path.join(path, "model.safetensors.index.json"), "wb") as f:
            f.write(index)
    return path


def _check_hf(base, config_bytes, index_bytes):
    pass_over_open("hf checkpoint", (config_bytes, index_bytes))
    path = _checkpoint_dir(base, config_bytes, index_bytes)
    cfg = works_or_user_error(hf_checkpoint.read_config, path)
    if cfg is REFUSED:
        return
    hf = json.loads(config_bytes)
    for key, (field, kind) in HF_FIELDS.items():
        if hf.get(key) is None or (key == "rope_theta" and hf.get("rope_parameters")):
            continue  # absent: a default applies; rope_parameters' rope_theta wins
        v = hf[key]
        ok = (is_int(v) if kind is int else isinstance(v, bool) if kind is bool else
              isinstance(v, (int, float)) and not isinstance(v, bool))
        assert ok and v == getattr(cfg, field), (key, v, getattr(cfg, field))


@pytest.mark.parametrize("profile", PROFILES)
def test_hf_config_json(profile, tiny_checkpoint):
    base, config, index = tiny_checkpoint
    configs = (mutated_json_object(config, keys=list(config) + ["num_local_experts",
                                                                "rope_parameters"])
               .map(json_bytes) | JSON.map(json_bytes)
               | damaged_bytes(json_bytes(config)))
    run(profile, configs, lambda c: _check_hf(base, c, json_bytes(index)))


@st.composite
def _mutated_index(draw, index):
    weight_map = dict(index["weight_map"])
    names, files = sorted(weight_map), sorted(set(weight_map.values()))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(names) | st.text(max_size=20))
        weight_map[name] = draw(st.sampled_from(files + ["missing.safetensors", "../x",
                                                         "", "/etc/passwd"]) | JSON)
    if draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(names), max_size=3)):
            weight_map.pop(name, None)
    out = draw(mutated_json_object({**index, "weight_map": weight_map}))
    return json_bytes(out)


@pytest.mark.parametrize("profile", PROFILES)
def test_hf_shard_index(profile, tiny_checkpoint):
    base, config, index = tiny_checkpoint
    indexes = (_mutated_index(index) | JSON.map(json_bytes)
               | damaged_bytes(json_bytes(index)) | st.none())
    run(profile, indexes, lambda i: _check_hf(base, json_bytes(config), i))


# -- a Hugging Face checkpoint: tokenizer.json ---------------------------------------

@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A Qwen-style byte-level BPE tokenizer.json (tests/hf_fixtures.py) as a dict."""
    from hf_fixtures import write_qwen_tokenizer
    path = tmp_path_factory.mktemp("tok")
    write_qwen_tokenizer(str(path))
    return json.loads((path / "tokenizer.json").read_text())


@st.composite
def _mutated_tokenizer(draw, tok: dict) -> bytes:
    """tokenizer.json with its model's fields (type, vocab, merges, unk token, …) or its
    top-level fields changed, dropped or added as any JSON value, merges naming tokens
    the vocab lacks, or the bytes damaged."""
    how = draw(st.sampled_from(["model", "top", "merges", "bytes"]))
    if how == "bytes":
        return draw(damaged_bytes(json_bytes(tok)))
    tok = json.loads(json.dumps(tok))
    if how == "model":
        tok["model"] = draw(mutated_json_object(tok["model"], values=JSON | st.sampled_from(
            ["BPE", "Unigram", "WordPiece", "WordLevel", "Foo", ""])))
    elif how == "top":
        tok = draw(mutated_json_object(tok))
    else:
        merges = tok["model"].get("merges") or []
        extra = draw(st.lists(st.text(max_size=4), min_size=1, max_size=3))
        tok["model"]["merges"] = merges[:draw(st.integers(0, len(merges)))] + [
            " ".join(extra[:2]) if draw(st.booleans()) else extra[:2]]
    return json_bytes(tok)


def _check_tokenizer(path: str, data: bytes):
    from stablerl_jax.data import hf_tokenizer
    with open(path, "wb") as f:
        f.write(data)
    tok = works_or_user_error(hf_tokenizer.read_tokenizer, path)
    if tok is not REFUSED:  # a tokenizer the library reads encodes and decodes text
        works_or_user_error(lambda: tok.decode(tok.encode("12 + 3 = 15").ids))


@pytest.mark.parametrize("profile", PROFILES)
def test_hf_tokenizer_json(profile, tokenizer_json, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    run(profile, _mutated_tokenizer(tokenizer_json), lambda data: _check_tokenizer(path, data))


# -- an offline rollout file ----------------------------------------------------------

V, E, L, K, P, C, G = 16, 4, 2, 2, 4, 4, 2  # vocab, experts, layers, top-k, budgets, group


@st.composite
def _responses(draw):
    """Responses as an engine records them (interop/rollouts.py), valid for the model
    above, in 1-3 groups of G."""
    out = []
    for _ in range(G * draw(st.integers(1, 3))):
        p, c = draw(st.integers(1, P)), draw(st.integers(1, C))
        ids = lambda n: draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
        experts = st.permutations(range(E)).map(lambda x: x[:K])
        routes = [[draw(experts) for _ in range(L)] for _ in range(p + c - 1)]
        out.append({"prompt_ids": ids(p), "completion_ids": ids(c),
                    "logp_mu": draw(st.lists(st.floats(-20, 0), min_size=c, max_size=c)),
                    "routes": routes, "reward": draw(st.floats(-1, 1))})
    return out


FIELDS = ["prompt_ids", "prompt_lens", "completion_ids", "completion_lens", "logp_mu",
          "routes", "route_weights", "rewards", "answers", "group_size"]
DTYPES = st.sampled_from([np.int8, np.int32, np.int64, np.uint8, np.uint64, np.float16,
                          np.float32, np.float64, np.bool_, np.complex64, "<U3"])


@st.composite
def _array_mutation(draw, arrays: dict) -> dict:
    """`arrays` with a field replaced by an array of another dtype / shape, an entry set
    to an extreme, a field dropped, or one added."""
    arrays = dict(arrays)
    field = draw(st.sampled_from(FIELDS))
    how = draw(st.sampled_from(["replace", "entry", "drop", "add"]))
    if how == "replace" or (how == "entry" and (field not in arrays
                                                 or arrays[field].size == 0)):
        arrays[field] = draw(hnp.arrays(DTYPES, hnp.array_shapes(min_dims=0, max_dims=3,
                                                                 min_side=0, max_side=6)))
    elif how == "entry":
        a = arrays[field].copy()
        extreme = draw(st.sampled_from([-1, 0, V, E, 2 ** 31, -(2 ** 31) - 1, 2 ** 62,
                                        math.nan, math.inf, -math.inf, 1e300, -1e300,
                                        -1e30, -10001.0, -3.4e38]))
        flat = a.reshape(-1)
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # 1e300 in float16: inf
                flat[draw(st.integers(0, flat.size - 1))] = extreme
        except (OverflowError, ValueError):  # not representable in this dtype
            a = a.astype(np.float64)
            a.reshape(-1)[0] = extreme
        arrays[field] = a
    elif how == "drop":
        arrays.pop(field, None)
    else:
        arrays[draw(st.text(min_size=1, max_size=6))] = np.zeros(draw(st.integers(0, 3)))
    return arrays


@st.composite
def _rollout_file(draw, path: str):
    """(`path`, written as an .npz rollout file; whether it is the valid file as
    write_rollouts wrote it)."""
    rollouts.write_rollouts(path, draw(_responses()), G)
    how = draw(st.sampled_from(["valid", "arrays", "bytes", "header"]))
    if how == "header":  # a member's .npy header claiming another (often huge) shape
        _forge_header(path, draw(st.sampled_from(FIELDS)),
                      draw(st.integers(0, 2 ** 62) | st.sampled_from([2 ** 31, 2 ** 40])))
    elif how == "arrays":
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        arrays = draw(_array_mutation(arrays))
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    elif how == "bytes":
        with open(path, "rb") as f:
            data = draw(damaged_bytes(f.read()))
        with open(path, "wb") as f:
            f.write(data)
    return path, how == "valid"


def _forge_header(path: str, field: str, entries: int) -> None:
    """Rewrite `field`'s .npy header in the archive to claim `entries` entries, its
    bytes unchanged."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    name = field + ".npy"
    if name not in members:
        return
    f = io.BytesIO(members[name])
    version = np.lib.format.read_magic(f)
    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
            else np.lib.format.read_array_header_2_0)
    _, fortran, dtype = read(f)
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(header, {"descr": np.lib.format.dtype_to_descr(
        dtype), "fortran_order": fortran, "shape": (entries,)})
    members[name] = header.getvalue() + members[name][f.tell():]
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)


def _check_rollouts(example):
    pass_over_open("rollouts", example)
    path, valid = example
    ro = works_or_user_error(rollouts.OfflineRollouts.load, path)
    if ro is REFUSED:
        assert not valid, "the file write_rollouts wrote is refused"
        return
    steps = max(ro.num_responses // G, 1)
    if works_or_user_error(ro.check, group_size=G, responses_per_step=G, steps=steps,
                           num_layers=L, top_k=K, need_routes=True,
                           need_weights=False) is REFUSED:
        assert not valid
        return
    if works_or_user_error(ro.check_values, vocab_size=V, num_experts=E, max_prompt_len=P,
                           max_new_tokens=C) is REFUSED:
        assert not valid
        return
    a, po, co = ro.arrays, 0, 0
    for s in range(steps):  # a file that passed every check trains: no error at all
        rows = np.arange(s * G, (s + 1) * G)
        rollout, rewards, _ = ro.batch(rows, max_prompt_len=P, max_new_tokens=C, pad_id=0,
                                       num_layers=L, top_k=K, num_experts=E)
        for i, r in enumerate(rows):  # every token and log-prob as the file holds it
            p, c = int(a["prompt_lens"][r]), int(a["completion_lens"][r])
            assert [int(x) for x in a["prompt_ids"][po:po + p]] == [
                int(x) for x in rollout.tokens_BxS[i, P - p:P]]
            assert [int(x) for x in a["completion_ids"][co:co + c]] == [
                int(x) for x in rollout.tokens_BxS[i, P:P + c]]
            assert np.array_equal(np.float32(a["logp_mu"][co:co + c]),
                                  rollout.logp_mu_BxS[i, P:P + c])
            po, co = po + p, co + c
        assert rewards is None or np.isfinite(rewards).all()
    assert (a["logp_mu"] >= rollouts.LOGP_FLOOR).all()  # a recorded log μ, not a sentinel


@pytest.mark.parametrize("profile", PROFILES)
def test_offline_rollout_file(profile, tmp_path):
    run(profile, _rollout_file(str(tmp_path / "rollouts.npz")), _check_rollouts)


# -- JSONL records ---------------------------------------------------------------------

MATH_RECORDS = [{"question": "What is 1+1?", "answer": "1 + 1 = 2\n#### 2"},
                {"problem": "Half of 3?", "solution": "It is \\boxed{\\frac{3}{2}}."},
                {"problem": "AIME 1", "answer": 5},
                {"question": "Square of 3?", "answer": "9"},
                {"prompt": "2*3=?", "answer": "6"},
                {"prompt": [{"role": "user", "content": "1+3?"}],
                 "reward_model": {"ground_truth": "4"}}]
SFT_RECORDS = [{"messages": [{"role": "user", "content": "1+1?"},
                             {"role": "assistant", "content": "2"}]},
               {"prompt": "1+2?", "response": "3"},
               {"question": "1+1?", "answer": "1 + 1 = 2\n#### 2"},
               {"problem": "Half of 3?", "solution": "It is \\boxed{\\frac{3}{2}}."}]


def _lines(records):
    record = st.sampled_from(records).flatmap(
        lambda r: mutated_json_object(r, keys=list(r) + ["messages", "answer"]))
    nested = st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n)
    line = (record.map(json_bytes) | JSON.map(json_bytes) | nested | st.binary(max_size=24)
            | st.sampled_from([b"", b"\xef\xbb\xbf{}", b"{", b"null", b'{"a": NaN}']))
    return st.lists(line, min_size=1, max_size=4).map(b"\n".join)


def _check_jsonl(path: str, data: bytes, **kwargs):
    pass_over_open("jsonl", data)
    with open(path, "wb") as f:
        f.write(data)
    _check_records(path, **kwargs)


def _check_records(path: str, **kwargs):
    """A JSONL or parquet file read with and without task.skip_malformed: refused in one
    line, or records whose fields are text."""
    for skip in (False, True):
        parsed = works_or_user_error(jsonl.parse_jsonl, path, skip, **kwargs)
        if parsed is REFUSED:
            continue
        for rec in parsed.records:  # what the record said, as text
            fields = {k: v for k, v in rec.items() if k != "messages"}
            assert all(isinstance(v, str) for v in fields.values()), rec
            assert all(isinstance(m["content"], str) and isinstance(m["role"], str)
                       for m in rec.get("messages", [])), rec


@pytest.mark.parametrize("profile", PROFILES)
def test_jsonl_math_records(profile, tmp_path):
    path = str(tmp_path / "train.jsonl")
    run(profile, _lines(MATH_RECORDS), lambda data: _check_jsonl(path, data))


@pytest.mark.parametrize("profile", PROFILES)
def test_jsonl_cold_start_records(profile, tmp_path):
    path = str(tmp_path / "train.jsonl")
    run(profile, _lines(SFT_RECORDS), lambda data: _check_jsonl(
        path, data, record=sft_data.read_record, needs="record with a response",
        format_field="sft.format"))


# -- parquet records -------------------------------------------------------------------

# verl's layout (DAPO-Math-17k, AIME 2024): a chat list of structs, a struct of the answer.
DAPO_RECORD = {"data_source": "math_dapo",
               "prompt": [{"role": "user", "content": "What is 1+3?"}],
               "ability": "MATH", "reward_model": {"ground_truth": "4", "style": "rule"},
               "extra_info": {"index": 0}}
# Values a parquet file holds and JSON does not: bytes, NaN and infinities, the int64
# bounds, dates, decimals.
PARQUET_SCALARS = (st.binary(max_size=8) | st.dates()
                   | st.sampled_from([math.nan, math.inf, -math.inf, 2 ** 63 - 1, -2 ** 63])
                   | st.decimals(min_value=-10 ** 6, max_value=10 ** 6, places=2))
PARQUET_VALUES = st.recursive(
    SCALARS | PARQUET_SCALARS, lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(min_size=1, max_size=8), inner, min_size=1, max_size=3),
    max_leaves=8)


@st.composite
def _parquet_file(draw, records, path: str):
    """`path` written by pyarrow from 1-4 mutated rows (as verl's scripts and
    datasets.to_parquet write theirs: the first row's keys are the columns), or those
    bytes damaged. Rows pyarrow cannot write as one table (a column of mixed types, an
    empty struct) are no file anyone has: passed over."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A record with up to three fields replaced by, or given, any value a parquet cell
    # holds, or deleted (a column name is never empty).
    row = st.sampled_from(records).flatmap(lambda r: mutated_json_object(
        r, keys=list(r) + ["messages", "answer", "question", "response"],
        values=PARQUET_VALUES, min_key_size=1))
    rows = draw(st.lists(row, min_size=1, max_size=4))
    assume(rows[0])
    try:
        pq.write_table(pa.Table.from_pylist(rows), path)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        assume(False)
    if draw(st.integers(0, 4)) == 0:
        with open(path, "rb") as f:
            data = draw(damaged_bytes(f.read()))
        with open(path, "wb") as f:
            f.write(data)
    return path


def _check_parquet(path: str, **kwargs):
    pass_over_open("parquet", path)
    _check_records(path, **kwargs)


@pytest.mark.parametrize("profile", PROFILES)
def test_parquet_math_records(profile, tmp_path):
    path = str(tmp_path / "train.parquet")
    run(profile, _parquet_file(MATH_RECORDS + [DAPO_RECORD], path),
        lambda p: _check_parquet(p))


@pytest.mark.parametrize("profile", PROFILES)
def test_parquet_cold_start_records(profile, tmp_path):
    path = str(tmp_path / "train.parquet")
    run(profile, _parquet_file(SFT_RECORDS, path), lambda p: _check_parquet(
        p, record=sft_data.read_record, needs="record with a response",
        format_field="sft.format"))
