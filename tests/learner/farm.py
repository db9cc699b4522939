"""Real farm processes for the learner's integration tests: policy server, workers, learner.

Every process writes to a log file (a full pipe would block it) and is killed by
pid when the test ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


class Farm:
    """Spawns processes into `logs`; `close` kills whatever is still running."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def server(self, name: str, model: Path, *extra: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = self.spawn(
            name,
            [
                "inference",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--torch-threads",
                "1",
                *extra,
            ],
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, self.log(name)[-2000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    return url
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{name} never became healthy")

    def worker(
        self,
        name: str,
        redis_url: str,
        run: str,
        url: str,
        model: Path,
        *,
        concurrency: int,
        max_tokens: int = 1,
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            name,
            [
                "workers",
                "--redis-url",
                redis_url,
                "--run",
                run,
                "--inference-urls",
                url,
                "--model",
                str(model),
                "--max-tokens",
                str(max_tokens),
                "--concurrency",
                str(concurrency),
                "--worker-id",
                name,
                *extra,
            ],
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@contextmanager
def farm(logs: Path) -> Iterator[Farm]:
    made = Farm(logs)
    try:
        yield made
    finally:
        made.close()


def step_records(log: str) -> list[dict[str, object]]:
    """The learner's per-step JSON log lines."""
    return [
        json.loads(line.split(" learner ", 1)[1])
        for line in log.splitlines()
        if '"event": "step"' in line
    ]


def toy_tasks(path: Path) -> Path:
    path.write_text(json.dumps({"env_spec": 'toy@{"difficulty": 0}'}) + "\n")
    return path


def two_rank_job(module: str, *args: str | Path) -> None:
    """Run `python -m module ARGS` as two ranks under torchrun (gloo on CPU); fail with its
    stderr unless every rank exits 0."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        module,
        *map(str, args),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
