"""`python -m bench datasets`: the learner's memory on a large dataset of prompts.

Writes two Parquet files of the same rows' shape (a question, an answer and a 1 KB
``context`` column of random hex, which no codec shrinks), one of about 1 MB and one of
about 1 GB (`--smoke`: 1 MB and 16 MB), in row groups of 65,536 rows. Each is then opened
by a fresh process (`bench._datasets_probe`: its resident set is its own) the way the learner
opens ``--tasks``: `learner.datasets.load_dataset` with ``--prompt-column question --reward
exact`` (the start-up conversion into the cache and the check of every row), then 10,000
rows drawn by the task sampler and read, as the feeder reads them. Per file it reports the
resident set after the draws (VmRSS), its high-water mark over the whole run (VmHWM, the
conversion included), the time to open the file the first time (conversion + check) and
the second (the cached conversion, check only), and the draw rate.

The claim (issue 39): the resident set on the 1 GB file stays within 100 MB of that on the
1 MB file. It holds because the rows are never all in memory: Parquet is converted batch by
batch into an Arrow stream, that stream is memory-mapped and its pages handed back to the
kernel (`ArrowSource.release`), and the index kept per row is 4 bytes (none here: all rows
are of level 0).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import _report as report
from launch.settings import HelpFormatter

ROW_GROUP = 65_536
CONTEXT_BYTES = 1024


def write_parquet(path: Path, target_bytes: int) -> int:
    """Write about `target_bytes` of rows to `path`; the number of rows written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    per_row = CONTEXT_BYTES + 40
    rows = max(1, target_bytes // per_row)
    written = 0
    schema = pa.schema(
        [("question", pa.string()), ("answer", pa.string()), ("context", pa.string())]
    )
    with pq.ParquetWriter(path, schema) as writer:
        while written < rows:
            n = min(ROW_GROUP, rows - written)
            numbers = np.arange(written, written + n)
            noise = rng.integers(0, 256, size=(n, CONTEXT_BYTES // 2), dtype=np.uint8)
            table = pa.table(
                {
                    "question": [f"What is {i} + 1?" for i in numbers],
                    "answer": [str(i + 1) for i in numbers],
                    "context": [row.tobytes().hex() for row in noise],
                },
                schema=schema,
            )
            writer.write_table(table, row_group_size=ROW_GROUP)
            written += n
    return rows


def probe(path: Path, cache: Path, draws: int) -> dict[str, Any]:
    """Open `path` as the learner does in a fresh process; what it measured."""
    argv = [sys.executable, "-m", "bench._datasets_probe", str(path), str(cache), str(draws)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"probe of {path} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout))


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| file | rows | size MB | RSS after draws MB | peak RSS MB | first open s | "
        "cached open s | draws/s |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['rows']} | {r['file_mb']:.1f} | {r['rss_mb']:.1f} | "
            f"{r['peak_mb']:.1f} | {r['first_open_s']:.1f} | {r['cached_open_s']:.1f} | "
            f"{r['draws_per_s']:.0f} |"
        )
    small, large = rows[0], rows[-1]
    lines.append(
        f"RSS on {large['label']} minus on {small['label']}: "
        f"{large['rss_mb'] - small['rss_mb']:.1f} MB (claim: under 100 MB)"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench datasets", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="1 MB and 16 MB (CI)")
    parser.add_argument("--json", action="store_true", help="table to stderr, JSON to stdout")
    parser.add_argument("--draws", type=int, default=10_000, help="rows drawn and read")
    args = parser.parse_args(argv)
    run = report.start("datasets", argv)
    sizes = [
        ("1 MB", 1 << 20),
        ("16 MB" if args.smoke else "1 GB", (16 if args.smoke else 1024) << 20),
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-datasets-") as tmp:
        for label, size in sizes:
            path = Path(tmp) / f"{label.replace(' ', '')}.parquet"
            rows = write_parquet(path, size)
            measured = probe(path, Path(tmp) / "cache", args.draws)
            file_mb = path.stat().st_size / 2**20
            results.append({"label": label, "rows": rows, "file_mb": file_mb, **measured})
    return report.emit(run, results, _table(results), args.json)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
