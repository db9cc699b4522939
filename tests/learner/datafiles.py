"""Dataset files for the tests, written with the libraries users write them with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pyarrow as pa

from tests.conftest import require


def saved(path: Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` as a directory `datasets.Dataset.save_to_disk` wrote."""
    hf_dataset(rows).save_to_disk(str(path))
    return path


def hf_dataset(rows: list[dict[str, Any]]) -> Any:
    """A `datasets.Dataset` of `rows`, its fingerprint given: datasets 5.2 hashes a table
    through dill, which cannot pickle pyarrow 25+'s MonthDayNano type (`from_list` fails)."""
    have = importlib.util.find_spec("datasets") is not None
    require(have, "Hugging Face datasets (pip install 'rollout-farm[dev]')")
    import datasets
    from datasets.table import InMemoryTable

    return datasets.Dataset(InMemoryTable(pa.Table.from_pylist(rows)), fingerprint="rows")
