"""Every TOML configuration shipped in the repository loads into its role's model."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.config import load_config
from farm.errors import ConfigError as FarmConfigError
from inference.config import load_server_config
from learner.config import Algorithm, LearnerConfig
from learner.errors import ConfigError as LearnerConfigError
from workers.config import WorkerConfig
from workers.errors import ConfigError as WorkerConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "deploy" / "config"


def test_every_shipped_toml_has_a_loader():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.toml")) == [
        "farm.toml",
        "inference.toml",
        "learner.toml",
        "worker.toml",
    ]


def test_learner_toml(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FARM_RUN", raising=False)
    cfg = LearnerConfig.load({}, CONFIG_DIR / "learner.toml")
    assert cfg.run == "prod"
    assert cfg.batch.algorithm is Algorithm.GRPO
    assert cfg.groups_per_batch == 16 and cfg.resume


def test_worker_toml(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FARM_CONCURRENCY", raising=False)
    cfg = WorkerConfig.load({}, CONFIG_DIR / "worker.toml")
    assert cfg.concurrency == 1024
    assert len(cfg.inference_urls) == 2


def test_inference_toml():
    cfg = load_server_config({}, CONFIG_DIR / "inference.toml")
    assert cfg.host == "0.0.0.0" and cfg.port == 8000


def test_farm_toml():
    cfg = load_config(CONFIG_DIR / "farm.toml")
    assert cfg.run == "local" and cfg.workers == 2


@pytest.mark.parametrize(
    ("load", "error"),
    [
        (
            lambda url: LearnerConfig.load({"redis_url": url}, CONFIG_DIR / "learner.toml"),
            LearnerConfigError,
        ),
        (
            lambda url: WorkerConfig.load({"redis_url": url}, CONFIG_DIR / "worker.toml"),
            WorkerConfigError,
        ),
        (lambda url: load_config(CONFIG_DIR / "farm.toml", redis_url=url), FarmConfigError),
    ],
    ids=["learner", "worker", "farm"],
)
def test_every_role_rejects_a_non_redis_url(load, error):
    with pytest.raises(error, match=r"unsupported Redis URL scheme .*must start with redis://"):
        load("http://127.0.0.1:6379/0")
