"""Hostile data files through the command line: offline rollout files (every value
checked when the file is opened), JSONL and parquet records a reader cannot hold, and
a run's logs linked elsewhere. Each is exit status 2 and one line naming the file
(field, line) and the fix, with nothing outside the workdir changed (the hostile file
included)."""
import io
import json
import os
import zipfile

import numpy as np
import pytest
from cli_helpers import jsonl_cfg, refused_outside_untouched
from rl_helpers import tiny_cfg

from stablerl_jax.data import jsonl
from stablerl_jax.interop.rollouts import write_rollouts
from stablerl_jax.rl import loop

# Offline rollout files: every value is checked when the file is opened.
ROLLOUT_CASES = [  # (case, change(arrays), record, field, the message must contain)
    ("token id beyond the vocabulary", lambda a: a["completion_ids"].__setitem__(
        slice(9, 10), 64), "completion_ids", "token id 64 is outside [0, model.vocab_size=64)"),
    ("negative prompt token", lambda a: a["prompt_ids"].__setitem__(slice(20, 21), -1),
     "prompt_ids", "token id -1"),
    ("NaN logp_mu", lambda a: a["logp_mu"].__setitem__(slice(9, 10), np.nan), "logp_mu",
     "nan is not a log-probability"),
    ("positive logp_mu", lambda a: a["logp_mu"].__setitem__(slice(9, 10), 0.5), "logp_mu",
     "0.5 is not a log-probability"),
    ("NaN reward", lambda a: a["rewards"].__setitem__(slice(1, 2), np.nan), "rewards",
     "nan is not finite"),
    ("negative completion length", lambda a: a["completion_lens"].__setitem__(
        slice(1, 2), -1), "completion_lens", "-1 is below 0"),
    ("completion longer than the slots", "long", "completion_lens", "17 is not in [1, 16]"),
    ("expert id beyond the experts", lambda a: a["routes"].__setitem__(
        (slice(30, 31), 1, 0), 8), "routes", "outside [0, model.num_experts=8)"),
    ("expert id -2", lambda a: a["routes"].__setitem__((slice(30, 31), 0, 1), -2),
     "routes", "outside [0, model.num_experts=8)"),
    ("logp_mu of -1e30", lambda a: a["logp_mu"].__setitem__(slice(9, 10), -1e30),
     "logp_mu", "-1e+30 is below -10000, the floor of a drawn token's log-probability"),
]


@pytest.mark.parametrize("case, change, field, needle", ROLLOUT_CASES,
                         ids=[c[0] for c in ROLLOUT_CASES])
def test_bad_offline_rollouts_are_refused_at_open(tmp_path, case, change, field, needle):
    cfg = tiny_cfg(replay="r3", steps=1)
    rng = np.random.default_rng(0)
    recs = [{"prompt_ids": rng.integers(4, 60, 5), "completion_ids": rng.integers(4, 60, c),
             "logp_mu": -rng.uniform(0.1, 2, c),
             "routes": np.stack([rng.permutation(8)[:2] for _ in range(4 + c) for _ in "LL"])
             .reshape(4 + c, 2, 2), "reward": float(i % 2)}
            for i, c in enumerate([4, 17 if change == "long" else 4] + [4] * 6)]
    path = tmp_path / "rollouts.npz"
    write_rollouts(str(path), recs, group_size=2)
    if change != "long":
        arrays = dict(np.load(path))
        change(arrays)
        np.savez(path, **arrays)
    cfg = cfg.replace(rl=cfg.rl.replace(offline_rollouts=str(path)))
    with pytest.raises(ValueError) as e:
        loop.open_offline(cfg)
    msg = str(e.value)
    assert str(path) in msg and f"field {field!r}" in msg and needle in msg, msg
    # The record: response 1 for per-response fields; entries 9, 20 and 30 fall in
    # responses 2, 4 and 3 (4 completion, 5 prompt and 8 route tokens per response).
    record = {"completion_ids": 2, "prompt_ids": 4, "logp_mu": 2, "routes": 3}.get(field, 1)
    assert f"record {record} (response index)" in msg, msg


def _rollouts(path, group_size=2, **fields):
    """A valid rollout file (8 responses, groups of `group_size`) with `fields` set."""
    rng = np.random.default_rng(0)
    write_rollouts(str(path), [{"prompt_ids": rng.integers(4, 60, 5),
                                "completion_ids": rng.integers(4, 60, 4),
                                "logp_mu": -rng.uniform(0.1, 2, 4), "reward": float(i % 2)}
                               for i in range(8)], group_size=group_size)
    if fields:
        np.savez(path, **{**dict(np.load(path)), **fields})  # object arrays are pickled
    return path


def _huge_header(path):
    """A rollout file whose prompt_ids member's .npy header claims 2^40 entries."""
    _rollouts(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False,
                                                  "shape": (2**40,)})
    members["prompt_ids.npy"] = header.getvalue() + bytes(64)  # 64 bytes, not 8 TB
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)
    return path


def _cut(path):
    data = _rollouts(path).read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


BAD_ROLLOUT_FILES = [  # (case, make(tmp_path) -> path, the line must contain)
    (".npy instead of .npz", lambda t: (np.save(t / "r.npy", np.zeros(3)), t / "r.npy")[1],
     ["a single .npy array", "not an .npz archive", "write_rollouts"]),
    ("truncated zip", lambda t: _cut(t / "r.npz"),
     ["not a readable .npz archive (BadZipFile", "write_rollouts"]),
    ("empty file", lambda t: ((t / "r.npz").write_bytes(b""), t / "r.npz")[1],
     ["not a readable .npz archive (EOFError", "write_rollouts"]),
    ("a text file", lambda t: (t / "r.npz").write_text("prompt_ids,1,2\n") and t / "r.npz",
     ["neither .npz nor .npy data, and never unpickled", "write_rollouts"]),
    ("group_size 0", lambda t: _rollouts(t / "r.npz", group_size=0),
     ["field 'group_size' is 0", "must be >= 1", "write_rollouts(..., group_size=G)"]),
    ("group_size [2, 2]", lambda t: _rollouts(t / "r.npz", group_size=np.array([2, 2])),
     ["field 'group_size' has shape (2,)", "write_rollouts(..., group_size=G)"]),
    ("pickled object array", lambda t: _rollouts(
        t / "r.npz", answers=np.array(["1", 2] * 4, dtype=object)),
     ["field 'answers' cannot be read (an object array: pickled Python objects, never "
      "unpickled)", "plain numeric or str array", "write_rollouts"]),
    ("lengths as strings", lambda t: _rollouts(t / "r.npz", prompt_lens=np.array(["5"] * 8)),
     ["field 'prompt_lens' has dtype <U1", "integers", "write_rollouts"]),
    ("routes of rank 2", lambda t: _rollouts(t / "r.npz", routes=np.zeros((64, 2), np.int32)),
     ["field 'routes' has shape (64, 2)", "3 dimension(s)", "write_rollouts"]),
    ("no such file", lambda t: t / "absent.npz", ["no such file", "rl.offline_rollouts"]),
    ("a header claiming 2^40 entries", lambda t: _huge_header(t / "r.npz"),
     ["field 'prompt_ids': its header says (1099511627776,) of int64 (8,796,093,022,208 "
      "bytes), but the archive holds 64 bytes of it", "write_rollouts"]),
]


@pytest.mark.parametrize("case, make, needles", BAD_ROLLOUT_FILES,
                         ids=[c[0] for c in BAD_ROLLOUT_FILES])
def test_hostile_rollout_files_are_one_line_naming_the_file(tmp_path, capsys, case, make,
                                                            needles):
    path = make(tmp_path)
    refused_outside_untouched(capsys, tmp_path, ["sft.steps=0",
                                                 f"rl.offline_rollouts={path}"],
                              f"{path}: ", *needles)


def _deep(path):
    path.mkdir()
    ok = json.dumps({"question": "1 + 2 = ?", "answer": "#### 3"}) + "\n"
    (path / "train.jsonl").write_text(ok + "[" * 100_000 + "]" * 100_000 + "\n" + ok)
    (path / "test.jsonl").write_text(ok)
    return path


def test_a_line_nested_100000_deep_is_one_line_or_skipped_and_counted(tmp_path, capsys):
    manual = _deep(tmp_path / "m")
    refused_outside_untouched(
        capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
        f"{manual / 'train.jsonl'}:2: malformed record", "nested deeper than the reader "
        "follows", "pass skip_malformed=True")
    data = loop.task_data(jsonl_cfg(manual, skip_malformed=True), str(tmp_path / "run2"))
    assert len(data.train) == 2
    assert jsonl.parse_jsonl(str(manual / "train.jsonl"), skip_malformed=True).skipped == 1
    # The generic path (another record reader: cold-start chats) shares load_object.
    from stablerl_jax.data import sft_data
    with pytest.raises(ValueError, match=r"train.jsonl:2: malformed record .* nested deeper"):
        jsonl.parse_jsonl(str(manual / "train.jsonl"), record=sft_data.read_record)
    assert jsonl.parse_jsonl(str(manual / "train.jsonl"), skip_malformed=True,
                             record=sft_data.read_record).skipped == 1


def _far_dates(values):
    """A parquet date32 column of `values` days after 1970-01-01 (3,000,000: year 10183,
    past Python's datetime.date)."""
    import pyarrow as pa

    return pa.array(values, pa.int32()).cast(pa.date32())


def test_a_parquet_cell_python_cannot_hold_is_a_malformed_row(tmp_path, capsys):
    # Found by tests/fuzz_files_test.py (parquet surface) as pyarrow's OverflowError, a traceback
    # for the whole file, even where no format reads the column; fixed in data/parquet.py.
    import pyarrow as pa
    import pyarrow.parquet as pq

    manual = tmp_path / "m"
    manual.mkdir()
    pq.write_table(pa.table({"question": ["1 + 2 = ?", "2 + 2 = ?"],
                             "answer": _far_dates([3_000_000, 3])}),
                   str(manual / "train.parquet"))
    pq.write_table(pa.table({"question": ["1 + 2 = ?"], "answer": ["3"]}),
                   str(manual / "test.parquet"))
    refused_outside_untouched(
        capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
        f"{manual / 'train.parquet'} row 1: malformed record", "field 'answer' must be a "
        "string, got Unreadable", "pass skip_malformed=True")
    with pytest.raises(ValueError, match=r"train.parquet: no records \(2 malformed"):
        jsonl.parse_jsonl(str(manual / "train.parquet"), skip_malformed=True)
    # In a column no format reads (verl's extra_info, say) it does not matter.
    pq.write_table(pa.table({"question": ["1 + 2 = ?", "2 + 2 = ?"], "answer": ["3", "4"],
                             "created": _far_dates([3, 3_000_000])}),
                   str(manual / "train.parquet"))
    parsed = jsonl.parse_jsonl(str(manual / "train.parquet"))
    assert [r["answer"] for r in parsed.records] == ["3", "4"] and parsed.skipped == 0


def test_a_reference_hash_line_holding_a_word_is_a_malformed_record(tmp_path, capsys):
    manual = tmp_path / "m"
    manual.mkdir()
    ok = json.dumps({"question": "1 + 2 = ?", "answer": "#### 3"}) + "\n"
    (manual / "train.jsonl").write_text(
        ok + json.dumps({"question": "q", "answer": "so #### eleventy 5"}) + "\n")
    (manual / "test.jsonl").write_text(ok)
    refused_outside_untouched(
        capsys, tmp_path, ["sft.steps=0", "task.kind=jsonl", f"task.jsonl_dir={manual}"],
        f"{manual / 'train.jsonl'}:2: malformed record", "'eleventy 5' is not a number")


LINKED_LOGS = [("metrics.jsonl", ["sft.steps=0"]), ("samples.jsonl", ["sft.steps=0"]),
               ("minibatches.jsonl", ["sft.steps=0"]),
               ("sft_run/metrics.jsonl", ["sft.steps=1"])]


@pytest.mark.integration
@pytest.mark.parametrize("log, overrides", LINKED_LOGS, ids=[c[0] for c in LINKED_LOGS])
@pytest.mark.parametrize("dangling", [False, True], ids=["to a file", "dangling"])
def test_a_linked_log_is_one_line_and_its_target_untouched(tmp_path, capsys, log,
                                                           overrides, dangling):
    # The run rewrites its logs by rename on start and resume, which would replace the
    # link and leave its target stale: refused, the link and its target as they were.
    target = tmp_path / "elsewhere" / "log.jsonl"
    target.parent.mkdir()
    if not dangling:
        target.write_text(json.dumps({"step": 0, "reward": 0.5}) + "\n")
    link = tmp_path / "run" / log
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    refused_outside_untouched(capsys, tmp_path, overrides,
                              f"{link} is a symbolic link (to '{target}')",
                              "replace the link by a regular file")
    assert link.is_symlink() and os.readlink(link) == str(target)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert log == "metrics.jsonl" or not metrics.exists() or metrics.stat().st_size == 0
