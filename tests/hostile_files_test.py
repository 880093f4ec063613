"""Hostile files a run reads: a checkpoint's tokenizer.json (data/hf_tokenizer.py) and
parquet data (data/parquet.py). A tokenizer.json over the size or count limits, or one
the `tokenizers` library refuses, is one ValueError naming the file before the library
sees it (one line at the command line, exit status 2); a parquet row over the JSONL line
limit is never decoded into Python and is malformed, as an over-long JSONL line is:
named, or skipped and counted under skip_malformed. Every file is written here (the
tokenizer from tests/hf_fixtures.py's Qwen3-style one)."""
import itertools
import json
import shutil
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_fixtures import write_qwen_tokenizer
from tokenizers import pre_tokenizers

from experiments import train
from stablerl_jax.data import hf_tokenizer, jsonl, parquet
from stablerl_jax.data.hf_tokenizer import HFTokenizer

FIX = "restore the checkpoint's tokenizer.json"


def _tokenizer_dir(path, change=None):
    """A Qwen3-style tokenizer directory at `path` whose tokenizer.json is `change`(its
    JSON object), or that text when `change` is a string; returns the file."""
    path.mkdir(exist_ok=True)
    write_qwen_tokenizer(path)
    file = path / "tokenizer.json"
    if change is not None:
        file.write_text(change if isinstance(change, str) else
                        json.dumps(change(json.loads(file.read_text()))))
    return file


def _refused(path, *needles):
    """The one-line ValueError of loading the tokenizer directory `path`."""
    with pytest.raises(ValueError) as e:
        HFTokenizer.from_dir(str(path))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    for needle in (f"{path / 'tokenizer.json'}: ", *needles):
        assert needle in msg, (needle, msg)
    return msg


def _with_model(**fields):
    return lambda t: {**t, "model": {**t["model"], **fields}}


def _merge_of_unknown_tokens(t):
    t["model"]["merges"].append(["zq", "qz"])
    return t


def _without_model(t):
    t.pop("model")
    return t


# (case, change of tokenizer.json or its text, the message must contain)
BAD_TOKENIZERS = [
    ("a merge of tokens not in the vocab", _merge_of_unknown_tokens,
     ["the tokenizers library cannot read it", "Token `zq` out of vocabulary", FIX]),
    ("an unknown model type", _with_model(type="Foo"),
     ["model type 'Foo' is not one the tokenizers library reads "
      "(BPE, Unigram, WordLevel, WordPiece)", FIX]),
    ("a model type that is not a string", _with_model(type=["BPE"]),
     ["model type ['BPE'] is not one the tokenizers library reads", FIX]),
    ("merges not a list", _with_model(merges="a b"),
     ["model.merges is a JSON str, not a list of merges", FIX]),
    ("a vocab not a map", _with_model(vocab=3),
     ["the tokenizers library cannot read it", "expected a map", FIX]),
    ("no model", _without_model, ['no "model" object', FIX]),
    ("a model that is not an object", lambda t: {**t, "model": "BPE"},
     ['no "model" object', FIX]),
    ("a list at the top", "[]", ["a JSON list, not the object of a tokenizer", FIX]),
    ("malformed JSON", '{"model": {"type": "BPE",', ["not valid JSON", FIX]),
    ("invalid UTF-8", b'{"model": "\xff"}', ["not valid JSON", FIX]),
    ("JSON nested 100,000 deep", "[" * 100_000 + "]" * 100_000,
     ["nested deeper than Python's recursion limit", FIX]),
    # Found by tests/fuzz_files_test.py: a prefix longer than a merge's right token made the
    # library panic (pyo3's PanicException, not an Exception: a traceback), and a
    # WordLevel model without its unk token loaded and then failed on the first text.
    ("a continuing_subword_prefix the merges lack", _with_model(
        continuing_subword_prefix="WordPiece"),
     ["merge 0", "does not start its right token with model.continuing_subword_prefix "
      "'WordPiece'", FIX]),
    ("a continuing_subword_prefix that is a number", _with_model(continuing_subword_prefix=3),
     ["model.continuing_subword_prefix is a JSON int, not a string or null", FIX]),
    ("a WordLevel model without its unk token", _with_model(type="WordLevel",
                                                             unk_token="[UNK]"),
     ["the tokenizer loads but cannot encode text", FIX]),
]


@pytest.mark.parametrize("case, change, needles", BAD_TOKENIZERS,
                         ids=[c[0] for c in BAD_TOKENIZERS])
def test_a_bad_tokenizer_json_is_one_line_naming_the_file(tmp_path, case, change, needles):
    if isinstance(change, bytes):
        _tokenizer_dir(tmp_path).write_bytes(change)
    else:
        _tokenizer_dir(tmp_path, change)
    _refused(tmp_path, *needles)


def test_a_tokenizer_json_over_the_size_limit_is_refused_unread(tmp_path):
    # A valid tokenizer (the library reads it) whose vocab holds one token that makes the
    # file a byte over the limit: refused from its size, never read into memory.
    file = _tokenizer_dir(tmp_path)
    raw = json.loads(file.read_text())
    raw["model"]["vocab"]["PAD"] = len(raw["model"]["vocab"])
    head, tail = (t.encode() for t in json.dumps(raw).split('"PAD"'))
    pad = hf_tokenizer.MAX_TOKENIZER_BYTES + 1 - len(head) - len(tail) - 2
    with open(file, "wb") as f:
        f.write(head + b'"')
        for n in range(0, pad, 1 << 20):
            f.write(b"x" * min(1 << 20, pad - n))
        f.write(b'"' + tail)
    assert file.stat().st_size == hf_tokenizer.MAX_TOKENIZER_BYTES + 1
    tracemalloc.start()
    try:
        _refused(tmp_path, f"{hf_tokenizer.MAX_TOKENIZER_BYTES + 1:,} bytes > "
                 f"MAX_TOKENIZER_BYTES ({hf_tokenizer.MAX_TOKENIZER_BYTES:,})", FIX)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("cap, what", [("MAX_VOCAB", "vocab entries"),
                                       ("MAX_MERGES", "merges"),
                                       ("MAX_ADDED_TOKENS", "added tokens")])
def test_a_tokenizer_json_over_a_count_limit_is_refused(tmp_path, monkeypatch, cap, what):
    # Ten million merges made the library abort the process (SIGABRT, 5.5 GB); the limit
    # is lowered here to one below the fixture's count to keep the file small.
    file = _tokenizer_dir(tmp_path)
    raw = json.loads(file.read_text())
    n = {"MAX_VOCAB": len(raw["model"]["vocab"]), "MAX_MERGES": len(raw["model"]["merges"]),
         "MAX_ADDED_TOKENS": len(raw["added_tokens"])}[cap]
    monkeypatch.setattr(hf_tokenizer, cap, n - 1)
    _refused(tmp_path, f"{n:,} {what} > {cap} ({n - 1:,}), far more than any real "
             "tokenizer", FIX)
    monkeypatch.setattr(hf_tokenizer, cap, n)  # at the limit: read
    assert HFTokenizer.from_dir(str(tmp_path)).vocab_size > 0


def _qwen3_sized(path):
    """A byte-level BPE tokenizer.json with Qwen3's counts (151,643 tokens: the 256 bytes
    and one per merge, 151,387 merges of two- then three-byte tokens, then 26 added
    tokens), merges as pairs (as `tokenizers` writes them); returns (file, its bytes)."""
    file = _tokenizer_dir(path)
    raw = json.loads(file.read_text())
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    pairs = itertools.product(alphabet, repeat=2)
    triples = ((a + b, c) for a, b, c in itertools.product(alphabet, repeat=3))
    merges = [[a, b] for a, b in itertools.islice(itertools.chain(pairs, triples), 151_387)]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    raw["model"].update(vocab=vocab, merges=merges)
    raw["added_tokens"] = [{"id": len(vocab) + i, "content": f"<|extra_{i}|>",
                            "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for i in range(26)]
    file.write_text(json.dumps(raw, ensure_ascii=False))
    return file, file.stat().st_size


def test_the_limits_hold_real_qwen_and_llama_tokenizers(tmp_path):
    # Qwen3: 11.4 MB, 151,669 tokens, 151,387 merges, 26 added; Llama 3: 9.1 MB, 128,256
    # tokens, 280,147 merges, 256 added (their published tokenizer.json files).
    assert hf_tokenizer.MAX_TOKENIZER_BYTES >= 4 * 11_400_000
    assert hf_tokenizer.MAX_VOCAB >= 4 * 151_669
    assert hf_tokenizer.MAX_MERGES >= 4 * 280_147
    assert hf_tokenizer.MAX_ADDED_TOKENS >= 4 * 256
    # A file of Qwen3's counts loads.
    file, size = _qwen3_sized(tmp_path)
    tok = HFTokenizer.from_dir(str(tmp_path), eos_token="<|extra_0|>",
                               pad_token="<|extra_0|>", bos_token=None)
    assert tok.vocab_size == 151_669 and size < hf_tokenizer.MAX_TOKENIZER_BYTES // 4
    assert tok.decode(tok.encode("What is 12 + 7?")) == "What is 12 + 7?"


def _parquet(path, questions, **columns):
    """A parquet file of GSM8K-style rows: `questions`, answers '#### 3', `columns`."""
    pq.write_table(pa.table({"question": questions,
                             "answer": ["#### 3"] * len(questions), **columns}), str(path))
    return str(path)


def _jsonl(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 3"}) + "\n"
                            for q in questions))
    return str(path)


def _parsed_with_peak(path, **kw):
    """parse_jsonl(path, **kw) and the peak of Python's allocations meanwhile (Arrow's
    own buffers are not Python's; the file's bytes, read through a Python file, are)."""
    tracemalloc.start()
    try:
        parsed = jsonl.parse_jsonl(path, **kw)
        return parsed, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_parquet_row_over_the_line_limit_is_malformed_and_never_decoded(tmp_path):
    limit = jsonl.MAX_LINE_BYTES
    answer = len("#### 3")
    # The row at the limit (question + answer: MAX_LINE_BYTES bytes) is read; one byte
    # more is an over-long row, as a JSONL line of the same record is an over-long line.
    at, over = "1" * (limit - answer), "1" * (limit + 1)
    f = _parquet(tmp_path / "train.parquet", ["1 + 2 = ?", at, over, "2 + 1 = ?"])
    with pytest.raises(jsonl.MalformedLineError) as e:
        jsonl.parse_jsonl(f)
    assert str(e.value) == (
        f"{f} row 3: malformed record of format 'gsm8k' (row of {limit + 1 + answer:,} "
        f"bytes > MAX_LINE_BYTES ({limit:,}; column 'question' holds {limit + 1:,})); "
        "fix the record, name the right task.format, or pass skip_malformed=True")
    parsed, peak = _parsed_with_peak(f, skip_malformed=True)
    assert parsed.skipped == 1 and [r["id"] for r in parsed.records] == [
        "train-0000001", "train-0000002", "train-0000004"]
    assert parsed.records[1]["prompt"] == at
    # The JSONL file of the same records: the same count, the same limit named.
    lines = _jsonl(tmp_path / "train.jsonl", ["1 + 2 = ?", "1 + 2 = ?", over, "2 + 1 = ?"])
    assert jsonl.parse_jsonl(lines, skip_malformed=True).skipped == 1
    with pytest.raises(jsonl.MalformedLineError, match=rf"train.jsonl:3: malformed record "
                       rf".*bytes > MAX_LINE_BYTES \({limit:,}\)"):
        jsonl.parse_jsonl(lines)
    # Without the row at the limit, Python never holds a megabyte: the row past it was
    # never decoded.
    f = _parquet(tmp_path / "test.parquet", ["1 + 2 = ?", over, "2 + 1 = ?"])
    parsed, peak = _parsed_with_peak(f, skip_malformed=True)
    assert parsed.skipped == 1 and len(parsed.records) == 2 and peak < limit // 2, peak


def test_a_64_mib_parquet_cell_is_skipped_without_being_decoded(tmp_path):
    # Such a cell took 64 s and 4.8 GB before the length filter dropped its row (256 MiB:
    # MemoryError); now its row is malformed before any of it reaches Python.
    f = _parquet(tmp_path / "train.parquet", ["1 + 2 = ?", "1" * (64 << 20), "2 + 1 = ?"])
    parsed, peak = _parsed_with_peak(f, skip_malformed=True)
    # Python holds only the file's compressed bytes (read through epath: ~3 MB here),
    # never the 64 MiB of the cell.
    assert parsed.skipped == 1 and len(parsed.records) == 2 and peak < 8 << 20, peak


def _chat(*turns):
    return [[{"role": "user", "content": t} for t in turns]] * 2


# Rows over the limit in their values together, in any column (as a JSONL line is over it
# whatever its fields): (case, extra columns of two rows, the message's column and bytes)
OVER_IN_TOTAL = [
    ("a chat of two 600 KB turns", {"chat": _chat("x" * 600_000, "y" * 600_000)},
     ("chat", 1_200_008)),
    ("140,000 int64s in a column no format reads",
     {"extra": [list(range(140_000))] * 2}, ("extra", 1_120_000)),
    ("a struct of two 600 KB strings",
     {"info": [{"a": "x" * 600_000, "b": "y" * 600_000}] * 2}, ("info", 1_200_000)),
    ("a dictionary-encoded 1.1 MB string",
     {"tag": pa.array(["t" * 1_100_000, "t" * 1_100_000]).dictionary_encode()},
     ("tag", 1_100_000)),
]


@pytest.mark.parametrize("case, columns, named", OVER_IN_TOTAL,
                         ids=[c[0] for c in OVER_IN_TOTAL])
def test_a_parquet_row_over_the_limit_in_total_is_malformed(tmp_path, case, columns, named):
    f = _parquet(tmp_path / "train.parquet", ["1 + 2 = ?", "2 + 1 = ?"], **columns)
    with pytest.raises(jsonl.MalformedLineError,
                       match=rf"row 1: malformed record .* > MAX_LINE_BYTES .*column "
                       rf"'{named[0]}' holds {named[1]:,}\)"):
        jsonl.parse_jsonl(f)
    with pytest.raises(ValueError, match=r"no records \(2 malformed row\(s\) skipped\)"):
        jsonl.parse_jsonl(f, skip_malformed=True)


def test_value_bytes_reads_sizes_from_offsets(tmp_path):
    strings = pa.array(["ab", None, "c" * 10])
    chats = pa.array([[{"role": "user", "content": "hello"}], None,
                      [{"role": "s", "content": "xy"}, {"role": "u", "content": "z"}]])
    cases = [
        (strings, [2, 0, 10]),
        (chats, [9, 0, 5]),
        (chats.slice(1), [0, 5]),
        (pa.array([{"a": "x" * 10}, {"a": "yy"}, None, {"a": "zzz"}]).slice(1), [2, 0, 3]),
        (pa.array([[1, 2], None, [3, 4]], pa.list_(pa.int64(), 2)).slice(1), [0, 16]),
        (pa.array(["a", "bb", None, "a"]).dictionary_encode(), [1, 2, 0, 1]),
        (pa.array([[("k", 1)], [], None], pa.map_(pa.string(), pa.int64())), [9, 0, 0]),
        (pa.array([True, None]), [1, 0]),
        (pa.array([None, None]), [0, 0]),
        (pa.array(["abc", None], pa.string_view()), [3, 0]),
    ]
    for array, want in cases:
        assert parquet.value_bytes(array).tolist() == want, array.type


# The same through the command line: one line, exit status 2, nothing trained, nothing
# outside the workdir changed.


def _snapshot(root, workdir):
    return sorted((str(p), p.lstat().st_size, p.lstat().st_mtime_ns)
                  for p in root.rglob("*") if workdir not in (p, *p.parents))


def _one_line(capsys, tmp_path, overrides, *needles):
    workdir = tmp_path / "run"
    before = _snapshot(tmp_path, workdir)
    with pytest.raises(SystemExit) as e:
        train.main(["--workdir", str(workdir), "--quiet", "--compile-cache=",
                         *overrides])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in (*needles, "--traceback for the full traceback"):
        assert needle in err, (needle, err)
    assert _snapshot(tmp_path, workdir) == before
    assert not (workdir / "checkpoints").exists() or not any(
        (workdir / "checkpoints").iterdir())


def test_a_hostile_tokenizer_json_is_one_line_at_the_command_line(tmp_path, capsys, hf_dir):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_dir, ckpt)
    file = _tokenizer_dir(ckpt, _merge_of_unknown_tokens)
    _one_line(capsys, tmp_path, ["--hf", str(ckpt), "sft.steps=0"], f"{file}: the "
              "tokenizers library cannot read it (Token `zq` out of vocabulary", FIX)


def test_an_over_long_parquet_row_is_one_line_at_the_command_line(tmp_path, capsys):
    manual = tmp_path / "m"
    manual.mkdir()
    f = _parquet(manual / "train.parquet", ["1 + 2 = ?", "1" * (jsonl.MAX_LINE_BYTES + 1)])
    _parquet(manual / "test.parquet", ["1 + 2 = ?"])
    _one_line(capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
              f"{f} row 2: malformed record", "> MAX_LINE_BYTES (1,048,576; column "
              "'question' holds 1,048,577)", "pass skip_malformed=True")
