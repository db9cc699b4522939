"""WorkerConfig: precedence, validation, and a --help that imports no torch."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.__main__ import load_config
from workers.errors import ConfigError
from workers.resources import loop_factory

BASE = ["--inference-urls", "http://a:1,http://b:2", "--model", "/m"]


def test_precedence_cli_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text('run = "from-toml"\nconcurrency = 7\nmax_turns = 3\n')
    monkeypatch.setenv("FARM_CONCURRENCY", "11")
    monkeypatch.setenv("FARM_MAX_TURNS", "4")
    cfg = load_config([*BASE, "--config", str(toml), "--max-turns", "5"])
    assert cfg.run == "from-toml"
    assert cfg.concurrency == 11
    assert cfg.max_turns == 5
    assert cfg.inference_urls == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "/m"], "at least one inference server"),
        ([*BASE, "--concurrency", "0"], "concurrency"),
        ([*BASE, "--run", "bad name"], "run"),
        ([*BASE, "--redis-url", "http://x"], "redis_url"),
        (["--inference-urls", "ftp://x", "--model", "/m"], "inference_urls"),
        ([*BASE, "--sandbox-backend", "chroot"], "sandbox_backend"),
        ([*BASE, "--env-step-timeout-s", "10", "--episode-timeout-s", "5"], "env_step_timeout_s"),
        ([*BASE, "--event-loop", "trio"], "event_loop"),
        ([*BASE, "--inference-max-connections", "0"], "inference_max_connections"),
    ],
)
def test_bad_values_are_clear_errors(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(argv)


def test_unknown_toml_key_and_missing_file(tmp_path: Path) -> None:
    toml = tmp_path / "w.toml"
    toml.write_text("concurrensy = 3\n")
    with pytest.raises(ConfigError, match="concurrensy"):
        load_config([*BASE, "--config", str(toml)])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([*BASE, "--config", str(tmp_path / "nope.toml")])


@pytest.mark.parametrize(("name", "loop_type"), [("uvloop", "uvloop.Loop"), ("asyncio", "")])
def test_event_loop_choice(name: str, loop_type: str) -> None:
    cfg = load_config([*BASE, "--event-loop", name])

    async def running_loop() -> str:
        loop = asyncio.get_running_loop()
        return f"{type(loop).__module__}.{type(loop).__name__}"

    with asyncio.Runner(loop_factory=loop_factory(cfg.event_loop)) as runner:
        got = runner.run(running_loop())
    assert got == (loop_type or "asyncio.unix_events._UnixSelectorEventLoop")


def test_open_files_limit_is_raised_to_the_hard_limit() -> None:
    probe = (
        "import resource\n"
        "from workers.resources import raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "got = raise_open_files_limit()\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got\n"
        "print(got, hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    got, hard = (int(x) for x in out.stdout.split())
    assert got > 256
    assert got == hard or hard < 0  # RLIM_INFINITY is -1: then a large finite soft limit


def test_worker_ids_default_unique() -> None:
    assert load_config(BASE).worker_id != load_config(BASE).worker_id


def test_help_lists_every_option_without_torch() -> None:
    code = (
        "import sys, runpy\n"
        "sys.argv = ['workers', '--help']\n"
        "try:\n    runpy.run_module('workers', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert not any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules), 'heavy import'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    from launch.settings import leaves
    from workers.config import WorkerConfig

    for name in leaves(WorkerConfig):  # every field of the role and of its sections
        assert "--" + name.replace("_", "-") in out.stdout


def test_bad_config_exits_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--model", "/m"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "at least one inference server" in out.stderr
