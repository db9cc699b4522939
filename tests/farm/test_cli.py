"""The `farm` command line: help without torch, config precedence, bad input, `farm status`.

`farm status` runs as a real subprocess against a private redis-server seeded
through the broker's own producer, consumer group, admission budget and policy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broker.admission import AdmissionBudget
from broker.connection import RedisSettings, connect
from broker.keys import WORKERS_GROUP, RunKeys
from broker.messages import PolicyVersion, Task
from broker.policy import publish_policy
from broker.producer import Producer
from farm.config import load_config
from farm.errors import ConfigError


def _farm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "farm", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from farm.cli import main\n"
        "try:\n    main(['up', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for flag in ("--redis-url", "--inference-urls", "--workers", "--metrics-port", "--config"):
        assert flag in result.stdout


def test_cli_beats_env_beats_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "farm.toml"
    toml.write_text('run = "from-toml"\nworkers = 7\nmax_steps = 3\nenv_spec = "toy@{}"\n')
    monkeypatch.setenv("FARM_WORKERS", "5")
    monkeypatch.setenv("FARM_MAX_STEPS", "9")
    cfg = load_config(toml, max_steps=11, run=None)
    assert cfg.max_steps == 11  # flag
    assert cfg.workers == 5  # env over TOML
    assert cfg.run == "from-toml"  # TOML where nothing else speaks
    assert cfg.env_spec == "toy@{}"


@pytest.mark.parametrize(
    ("toml_text", "kwargs", "message"),
    [
        ("wrokers = 2\n", {}, "wrokers"),
        ("", {"redis_url": "http://x"}, "redis_url"),
        ("", {"workers": -1}, "workers"),
        ("", {"env_spec": "toy@[1]"}, "env_spec"),
        ("workers = [\n", {}, "cannot read"),
    ],
)
def test_bad_config_is_a_clear_error(
    tmp_path: Path, toml_text: str, kwargs: dict[str, object], message: str
) -> None:
    toml = tmp_path / "farm.toml"
    toml.write_text(toml_text)
    with pytest.raises(ConfigError, match=message):
        load_config(toml, **kwargs)


def test_missing_config_file_is_reported() -> None:
    result = _farm("up", "--config", "/nonexistent/farm.toml")
    assert result.returncode == 1
    assert "config file /nonexistent/farm.toml does not exist" in result.stderr


async def test_status_shows_streams_lag_pending_policy_and_budget(broker_url) -> None:
    keys = RunKeys("cli")
    redis = await connect(RedisSettings.from_url(broker_url))
    try:
        tasks = [Task(f"t{i}", "toy@{}", 2, i, 0) for i in range(5)]
        await redis.xgroup_create(keys.tasks, WORKERS_GROUP, id="0", mkstream=True)
        await Producer(redis).publish(keys.tasks, tasks)
        await redis.xreadgroup(WORKERS_GROUP, "w-1", {keys.tasks: ">"}, count=2)
        budget = AdmissionBudget(redis, keys)
        await budget.set_limit(16)
        assert await budget.try_acquire(5) == 5
        await publish_policy(redis, keys, PolicyVersion(version=3, step=3))
    finally:
        await redis.aclose()
    result = _farm("status", "--redis-url", broker_url, "--run", "cli")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "policy version 3" in out
    assert "admission 5/16 in flight" in out
    assert f"stream {keys.tasks}: 5 entries" in out
    assert "group workers: consumers 1, lag 3, pending 2" in out
    assert "w-1: 2 pending" in out


def test_status_of_an_unreachable_redis_fails_clearly(tmp_path: Path) -> None:
    from tests.conftest import free_port

    result = _farm("status", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", timeout=60)
    assert result.returncode == 1
    assert "unreachable" in result.stderr


def test_status_rejects_a_bad_url() -> None:
    result = _farm("status", "--redis-url", "http://127.0.0.1:1")
    assert result.returncode == 1
    assert "unsupported Redis URL scheme" in result.stderr


def test_status_checks_the_run_with_the_runs_own_rules() -> None:
    result = _farm("status", "--run", "a b", "--partitions", "0")
    assert result.returncode == 1
    assert "--run: String should match pattern" in result.stderr
    assert "--partitions: Input should be greater than or equal to 1" in result.stderr


def test_env_is_an_alias_of_env_spec_for_up_and_demo() -> None:
    from farm.cli import parser
    from farm.config import FarmConfig
    from launch.settings import flag_values

    for command in ("up", "demo"):
        args = flag_values(
            parser().parse_args([command, "--env", 'lookup@{"max_turns": 2}']), FarmConfig
        )
        assert load_config(None, **args).env_spec == 'lookup@{"max_turns": 2}'
    with pytest.raises(ConfigError):
        load_config(None, env_spec="lookup@[1]")


def test_flags_come_from_the_config_model_with_the_users_names() -> None:
    from farm.cli import parser
    from farm.config import FarmConfig
    from launch.settings import flag_values

    argv = [
        *("up", "--env-modules", "a", "--env-modules", "b,c", "--partitions", "2"),
        *("--learner-arg=--tracker=x,y", "--learner-arg=--resume", "--worker-arg=--max-tokens=2"),
    ]
    cfg = load_config(None, **flag_values(parser().parse_args(argv), FarmConfig))
    assert cfg.env_modules == ["a", "b", "c"]
    assert cfg.learner_args == ["--tracker=x,y", "--resume"]  # items kept whole, not split
    assert cfg.worker_args == ["--max-tokens=2"]
    assert cfg.partitions == 2


def test_eval_keeps_the_stacks_flags_and_passes_the_rest_to_the_learner() -> None:
    from farm.cli import parser

    args, rest = parser().parse_known_args(
        ["eval", "--env-modules", "m", "--workers", "1", "--eval-k", "4", "--max-steps", "3"]
    )
    assert (args.env_modules, args.workers) == (["m"], "1")
    assert rest == ["--eval-k", "4", "--max-steps", "3"]  # not the farm's: the command's
