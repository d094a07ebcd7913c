"""The python_mc task's documents: python_mc.jsonl beside this file, as a test split."""

import json
from pathlib import Path

import datasets


def load_docs(**kwargs) -> datasets.DatasetDict:
    path = Path(__file__).with_name("python_mc.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
