"""GSM8K-style JSONL data from a local directory (never downloaded).

Expected files in `jsonl_dir` (the TFDS manual directory): `train.jsonl` and `test.jsonl`,
one JSON object per line with "question" and "answer", the answer ending in "#### N"
(GSM8K's format; MATH-style data can be converted to it). Records get the same fields as
the synthetic task: id, prompt (the question), solution (the answer text), answer (N).

A malformed line is an error naming the file and line number, unless `skip_malformed`
is set, in which case such lines are skipped and counted.
"""
from __future__ import annotations

import json
import os

import tensorflow_datasets as tfds

from stablerl_jax.data.rewards import parse_final_answer


class MalformedLineError(ValueError):
    pass


def parse_jsonl(path: str, skip_malformed: bool = False) -> tuple[list[dict], int]:
    """(records, number of skipped malformed lines)."""
    records, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                question, solution = obj["question"], obj["answer"]
                if not isinstance(question, str) or not isinstance(solution, str):
                    raise TypeError("question and answer must be strings")
                answer = parse_final_answer(solution)
                if answer is None:
                    raise ValueError("answer has no final '#### N' line")
            except (ValueError, KeyError, TypeError) as e:
                if skip_malformed:
                    skipped += 1
                    continue
                raise MalformedLineError(f"{path}:{lineno}: malformed record ({e}); fix the "
                                         "line or pass skip_malformed=True") from None
            records.append({"id": f"{os.path.basename(path)}:{lineno}", "prompt": question,
                            "solution": solution, "answer": answer})
    return records, skipped


class JsonlMathConfig(tfds.core.BuilderConfig):
    def __init__(self, name: str = "default", skip_malformed: bool = False):
        super().__init__(name=name + ("_skip" if skip_malformed else ""), version="1.0.0")
        self.skip_malformed = skip_malformed


class JsonlMath(tfds.core.GeneratorBasedBuilder):
    """GSM8K-style JSONL files from the manual dir, written as array_record."""

    VERSION = tfds.core.Version("1.0.0")
    MANUAL_DOWNLOAD_INSTRUCTIONS = ("Place train.jsonl and test.jsonl (fields 'question' and "
                                    "'answer' ending in '#### N') in the manual directory.")

    def _info(self):
        text = tfds.features.Text()
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(
            {"id": text, "prompt": text, "solution": text, "answer": text}))

    def _split_generators(self, dl_manager):
        return {s: self._generate_examples(os.path.join(dl_manager.manual_dir, f"{s}.jsonl"))
                for s in ("train", "test")}

    def _generate_examples(self, path):
        records, self.skipped = parse_jsonl(path, self.builder_config.skip_malformed)
        for rec in records:
            yield rec["id"], rec


def load_jsonl_split(task, split: str, data_dir: str, skip_malformed: bool = False):
    """Build (once) from task.jsonl_dir and read a split through the data source."""
    builder = JsonlMath(config=JsonlMathConfig(skip_malformed=skip_malformed),
                        data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=task.jsonl_dir))
    source = builder.as_data_source()[split]
    return [{k: v.decode() if isinstance(v, bytes) else v for k, v in source[i].items()}
            for i in range(len(source))]
