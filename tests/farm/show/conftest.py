"""Fixtures for the `show` tests: the tiny model's chat codec and a run on a private Redis."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from broker.__main__ import main as broker_main
from broker.codec import encode
from broker.keys import RunKeys
from broker.messages import TrajectoryGroup
from farm.show.cli import main as show_main
from workers.tokens import ChatCodec, load_codec

RUN = "shw"


@pytest.fixture(scope="session")
def codec(tiny_model_dir: Path) -> ChatCodec:
    return load_codec(str(tiny_model_dir))


@dataclass
class Run:
    """A run's trajectories stream on a private redis-server, and the CLI pointed at it."""

    client: redis.Redis
    keys: RunKeys
    capsys: pytest.CaptureFixture[str]

    def publish(self, group: TrajectoryGroup) -> str:
        """XADD the group as a worker's producer encodes it; return the entry id."""
        return self.client.xadd(self.keys.trajectories(), encode(group)).decode()

    def add_raw(self, fields: dict[bytes, bytes], stream: str | None = None) -> str:
        return self.client.xadd(stream or self.keys.trajectories(), fields).decode()

    def cli(self, *argv: str) -> tuple[int, str, str]:
        """`python -m broker ...` in this process: (exit status, stdout, stderr). `show` runs
        as `farm.show` runs it: the broker's command execs that module."""
        self.capsys.readouterr()
        code = (show_main if argv[:1] == ("show",) else broker_main)(list(argv))
        out, err = self.capsys.readouterr()
        return code, out, err


@pytest.fixture
def run(
    redis_server, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Run]:
    monkeypatch.setenv("FARM_REDIS_URL", redis_server.url)
    monkeypatch.setenv("FARM_RUN", RUN)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at the terminal width: keep lines whole
    client = redis.Redis.from_url(redis_server.url)
    yield Run(client, RunKeys(RUN), capsys)
    client.close()
