"""Task datasets, read lazily: JSONL, Parquet and a directory `datasets.save_to_disk` wrote.

A file holds either task lines (each row names its ``env_spec``; ``difficulty``,
``max_turns``, ``meta`` and ``row`` are optional) or, with ``--prompt-column`` /
``--messages-column`` (`learner.dataspec.DataConfig`), rows of a dataset of prompts, each a
task of the ``dataset`` environment that carries the whole row. `load_dataset` reads every
row once at start-up and checks it (its spec against the registry, its columns against the
``dataset`` env's needs, its packed size against ``max_row_bytes``), so a bad row stops the
learner before any task is issued, naming its line (JSONL) or row (Parquet, Arrow).

Invariant: memory does not grow with the file. What stays after the check is an index:

- JSONL: each row's byte offset (8 bytes a row); a row is read back with a seek;
- a `datasets` directory: its Arrow files, memory-mapped (zero copy), a row sliced out when
  drawn; the pages read are handed back to the kernel (``MADV_DONTNEED``) after the check and
  every `RELEASE_EVERY` rows, so the resident set stays flat however large the file;
- Parquet: converted once, batch by batch, into an Arrow stream in the cache directory
  (keyed by the file's path, size and modification time), then read as Arrow.

A task file's difficulties are kept as one int32 per row (the curriculum draws on them).
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import mmap
import os
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import msgpack
import numpy as np

import envs
from learner.dataspec import DataConfig
from learner.errors import TaskSourceError

TASK_KEYS = frozenset({"env_spec", "difficulty", "max_turns", "meta", "row"})
# Rows read from a mapped file between two hand-backs of its pages. One row's read maps
# ~350 KB here (the kernel maps whole large folios of the page cache, not 4 KB pages), so
# 64 reads hold ~20 MB; a hand-back costs a page-table walk of the mapping (~0.1 ms/GB).
RELEASE_EVERY = 64
BATCH_ROWS = 1024  # rows per batch of a conversion and of the start-up check
CONVERSION = "1"  # the cache's format: a change re-converts every file


@dataclass(frozen=True)
class TaskRow:
    """One dataset row, as a task is issued from it."""

    env_spec: str
    difficulty: int = 0
    max_turns: int | None = None
    meta: dict[str, Any] | None = None
    row: dict[str, Any] | None = None  # the fields the environment gets at reset


class RowReader:
    """Turns a file's records into `TaskRow`s: `check` at start-up (ValueError), `make` after.

    A file whose rows have an ``env_spec`` column is a task file, whatever the flags say (so
    a run may train on a dataset of prompts and evaluate on a task file); any other file is
    a dataset of prompts, every row a task of `spec` (`DataConfig.env_spec`).
    """

    def __init__(self, data: DataConfig) -> None:
        self.data = data
        self.prompt_spec = data.env_spec()
        self.spec: str | None = None  # the file's rows' spec: None for a task file
        self._checked: OrderedDict[str, None] = OrderedDict()  # specs seen, bounded
        self._env_config: Any = None
        self._task_file = True
        if self.prompt_spec is not None:
            from envs.dataset import DatasetEnvConfig
            from envs.rewards import resolve

            _, kwargs = envs.check_spec(self.prompt_spec)
            self._env_config = DatasetEnvConfig.model_validate(kwargs)
            resolve(self._env_config.reward)  # a user's reward module imports here, or fails

    def read_columns(self, columns: Collection[str]) -> None:
        """Take the file's kind from its columns (a JSONL file's first row's keys)."""
        self.spec = None if "env_spec" in columns else self.prompt_spec
        self._task_file = "env_spec" in columns

    def _check_spec(self, spec: str) -> None:
        if spec in self._checked:
            return
        envs.check_spec(spec)  # EnvSpecError: the caller names the row
        self._checked[spec] = None
        if len(self._checked) > 4096:  # a file of distinct specs must not grow this
            self._checked.popitem(last=False)

    def check(self, record: Any) -> TaskRow:
        """The task of one record; ValueError (or EnvSpecError) says what is wrong with it."""
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        if not self._task_file:
            if self.spec is None:
                raise ValueError(
                    "no env_spec: a task file names each row's env_spec; for a dataset of "
                    "prompts give --prompt-column or --messages-column, and --reward"
                )
            from envs.dataset import check_row

            check_row(self._env_config, record)
            self._check_size(record)
            return TaskRow(self.spec, row=record)
        unknown = set(record) - TASK_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in a task file's row")
        spec = record.get("env_spec")
        if not isinstance(spec, str) or not spec:
            raise ValueError("env_spec must be a non-empty string")
        self._check_spec(spec)
        row = record.get("row")
        if row is not None:
            if not isinstance(row, dict):
                raise ValueError(f"row must be an object of fields, got {type(row).__name__}")
            self._check_size(row)
        return self.make(record)

    def make(self, record: dict[str, Any]) -> TaskRow:
        """The task of a record already checked."""
        if not self._task_file and self.spec is not None:
            return TaskRow(self.spec, row=record)
        max_turns = record.get("max_turns")
        return TaskRow(
            record["env_spec"],
            int(record.get("difficulty") or 0),
            None if max_turns is None else int(max_turns),
            record.get("meta"),
            record.get("row"),
        )

    def _check_size(self, row: dict[str, Any]) -> None:
        try:
            size = len(msgpack.packb(row, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"the row cannot travel with its task (msgpack): {exc}") from None
        if size > self.data.max_row_bytes:
            raise ValueError(
                f"the row packs to {size} bytes, over --max-row-bytes {self.data.max_row_bytes}"
            )


class TaskSource(Sequence[TaskRow]):
    """A dataset's rows by index, read on demand; `difficulties` per row (None: all 0)."""

    difficulties: np.ndarray | None = None

    @overload
    def __getitem__(self, index: int) -> TaskRow: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[TaskRow]: ...
    def __getitem__(self, index: int | slice) -> TaskRow | Sequence[TaskRow]:
        if isinstance(index, slice):
            return [self.row(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.row(index)

    def row(self, index: int) -> TaskRow:
        raise NotImplementedError


class JsonlSource(TaskSource):
    """JSONL rows by byte offset."""

    def __init__(self, path: Path, reader: RowReader) -> None:
        self.path, self.reader = path, reader
        offsets, difficulties = array.array("q"), array.array("i")  # no int object a row
        offset = 0
        try:
            with path.open("rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            record = json.loads(line)
                        except ValueError as exc:
                            raise TaskSourceError(f"{path}:{number}: not JSON: {exc}") from None
                        if not offsets:  # the first row tells a task file from prompts
                            reader.read_columns(record if isinstance(record, dict) else ())
                        task = _checked(reader, f"{path}:{number}", record)
                        offsets.append(offset)
                        difficulties.append(task.difficulty)
                    offset += len(line)
        except OSError as exc:
            raise TaskSourceError(f"cannot read task dataset {path}: {exc}") from exc
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        found = np.frombuffer(difficulties, dtype=np.int32)
        if found.any():
            self.difficulties = found

    def __len__(self) -> int:
        return len(self.offsets)

    def row(self, index: int) -> TaskRow:
        with self.path.open("rb") as f:  # opened per row: nothing held open between draws
            f.seek(int(self.offsets[index]))
            line = f.readline()
        return self.reader.make(json.loads(line))


class ArrowSource(TaskSource):
    """Rows of memory-mapped Arrow stream files (zero copy), pages handed back as it goes."""

    def __init__(self, files: list[Path], label: str, reader: RowReader) -> None:
        import pyarrow as pa

        self.reader = reader
        self._maps: list[mmap.mmap] = []
        tables = []
        try:
            for path in files:
                with path.open("rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps.append(mapped)
                stream = pa.ipc.open_stream(pa.BufferReader(pa.py_buffer(mapped)))
                tables.append(stream.read_all())
            self.table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise TaskSourceError(f"cannot read the Arrow data of {label}: {exc}") from exc
        self._reads = 0
        reader.read_columns(self.table.column_names)
        self.difficulties = self._check(label)
        self.release()

    def _check(self, label: str) -> np.ndarray | None:
        difficulties = np.zeros(len(self), dtype=np.int32)
        index = 0
        for batch in self.table.to_batches(max_chunksize=BATCH_ROWS):
            for record in batch.to_pylist():
                difficulties[index] = _checked(
                    self.reader, f"{label} row {index}", record
                ).difficulty
                index += 1
            if index % (BATCH_ROWS * 8) == 0:  # ~8 MB of pages read, handed back
                self.release()
        return difficulties if difficulties.any() else None

    def __len__(self) -> int:
        return self.table.num_rows

    def row(self, index: int) -> TaskRow:
        record = self.table.slice(index, 1).to_pylist()[0]
        self._reads += 1
        if self._reads % RELEASE_EVERY == 0:
            self.release()
        return self.reader.make(record)

    def release(self) -> None:
        """Hand the mapped pages read so far back to the kernel (they are re-read on need)."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)


def _checked(reader: RowReader, where: str, record: Any) -> TaskRow:
    """`reader.check(record)`, its errors named after the row."""
    try:
        return reader.check(record)
    except envs.EnvSpecError as exc:
        spec = record.get("env_spec") if isinstance(record, dict) else None
        raise TaskSourceError(f"{where}: bad env_spec {spec or reader.spec!r}: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise TaskSourceError(f"{where}: {exc}") from None


def load_dataset(path: Path, data: DataConfig | None = None) -> TaskSource:
    """Open and check a dataset (TaskSourceError names the file and the row). A process
    that opens the same unchanged file twice (the learner's start-up check, then its
    feeder) checks it once."""
    data = data or DataConfig()
    try:
        stat = path.stat()
    except OSError as exc:
        raise TaskSourceError(f"cannot read task dataset {path}: {exc}") from exc
    return _load(path, data, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: Path, data: DataConfig, size: int, mtime_ns: int) -> TaskSource:
    try:
        reader = RowReader(data)
    except envs.EnvSpecError as exc:
        raise TaskSourceError(f"{path}: {exc}") from None
    if path.is_dir():
        source: TaskSource = ArrowSource(_saved_dataset_files(path), str(path), reader)
    elif path.suffix == ".parquet":
        source = ArrowSource([_converted(path, data.cache_dir)], str(path), reader)
    else:
        source = JsonlSource(path, reader)
    if not len(source):
        raise TaskSourceError(f"task dataset {path} has no rows")
    return source


def _saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a `datasets.Dataset.save_to_disk` directory, in order."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise TaskSourceError(
            f"{path} holds several splits ({', '.join(splits)}): give one split's directory"
        )
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TaskSourceError(
            f"{path} is not a directory written by datasets' save_to_disk: {exc}"
        ) from exc
    if not files:
        raise TaskSourceError(f"task dataset {path} has no data files")
    return files


def _converted(path: Path, cache_dir: Path) -> Path:
    """`path` (Parquet) as an Arrow stream file in `cache_dir`, converted once per version of
    the file, batch by batch: buffered reads, no pre-buffering and one thread, so a row
    group is never read whole (pyarrow's defaults read a 128 MB row group at 4x its size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        stat = path.stat()
    except OSError as exc:
        raise TaskSourceError(f"cannot read task dataset {path}: {exc}") from exc
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION}"
    out = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.arrow"
    if out.is_file():
        return out
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        parquet = pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, parquet.schema_arrow) as w:
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, use_threads=False):
                w.write_batch(batch)
        tmp.replace(out)
    except (OSError, pa.ArrowException) as exc:
        tmp.unlink(missing_ok=True)
        raise TaskSourceError(f"cannot read Parquet file {path}: {exc}") from exc
    finally:
        pa.default_memory_pool().release_unused()
    return out
