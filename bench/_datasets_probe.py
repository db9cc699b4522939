"""One measured process of `bench datasets`: open a Parquet file as the learner does, draw.

``python -m bench._datasets_probe FILE CACHE_DIR DRAWS`` prints one JSON object: the
resident set after the draws and its high-water mark (MB), the first and the cached open
(s), the draw rate. Everything the learner imports to read a dataset is imported before
the measurement starts, so both files pay the same start-up.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def main(argv: list[str]) -> int:
    import pyarrow  # noqa: F401  (imported before the clock starts, as the learner has it)

    from learner.config import CurriculumRules
    from learner.datasets import _load, load_dataset
    from learner.dataspec import DataConfig
    from learner.tasks import TaskSampler

    path, cache, draws = Path(argv[0]), Path(argv[1]), int(argv[2])
    data = DataConfig(prompt_column="question", reward="exact", dataset_cache_dir=cache)
    t0 = time.perf_counter()
    source = load_dataset(path, data)
    first = time.perf_counter() - t0
    _load.cache_clear()  # a restarted learner: the conversion is cached, the check is not
    t0 = time.perf_counter()
    source = load_dataset(path, data)
    cached = time.perf_counter() - t0
    sampler = TaskSampler(source, seed=0, rules=CurriculumRules())
    t0 = time.perf_counter()
    for _ in range(draws):
        _, row, _ = sampler.draw_row()
        assert row.row is not None
    drawn = time.perf_counter() - t0
    result = {
        "rss_mb": _status_mb("VmRSS"),
        "peak_mb": _status_mb("VmHWM"),
        "first_open_s": first,
        "cached_open_s": cached,
        "draws_per_s": draws / drawn,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
