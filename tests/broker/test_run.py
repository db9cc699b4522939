"""broker.run: the run's shared settings, validated once with one pattern and one bound."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from broker.cli_config import BrokerCliConfig
from broker.connection import DEFAULT_REDIS_URL
from broker.keys import MAX_PARTITIONS, RUN_NAME_PATTERN
from broker.run import RunFields, RunSection
from farm.config import FarmConfig
from launch.settings import add_flags, flag_values, render_flags
from learner.config import LearnerConfig
from workers.config import WorkerConfig


def test_defaults_and_keys() -> None:
    section = RunSection()
    assert (section.run, section.redis_url, section.partitions) == ("demo", DEFAULT_REDIS_URL, 1)
    keys = RunSection(run="r", partitions=3).keys()
    assert (keys.run, keys.partitions) == ("r", 3)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"run": "a:b"}, "String should match pattern"),
        ({"run": ""}, "String should match pattern"),
        ({"run": "x" * 65}, "String should match pattern"),
        ({"partitions": 0}, "greater than or equal to 1"),
        ({"partitions": MAX_PARTITIONS + 1}, f"less than or equal to {MAX_PARTITIONS}"),
        ({"redis_url": "http://h:1"}, "redis"),
        ({"env_module": ["m"]}, "Extra inputs are not permitted"),
    ],
)
def test_bad_values_are_refused_with_a_clear_error(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunSection.model_validate(values)


ROLES = [
    (LearnerConfig, {"model": Path("m")}),
    (WorkerConfig, {"model": Path("m"), "inference_urls": ["http://127.0.0.1:1"]}),
    (BrokerCliConfig, {}),
    (FarmConfig, {}),
]


@pytest.mark.parametrize(("role", "required"), ROLES)
def test_every_role_checks_the_run_with_the_same_rules(
    role: type, required: dict[str, object]
) -> None:
    for bad, message in (
        ({"run": "a b"}, RUN_NAME_PATTERN),
        ({"partitions": MAX_PARTITIONS + 1}, f"less than or equal to {MAX_PARTITIONS}"),
    ):
        with pytest.raises(ValidationError) as info:
            role.model_validate({**required, **bad})
        assert message in str(info.value)


def test_the_section_renders_to_the_flags_every_role_reads() -> None:
    section = RunSection(run="r", redis_url="redis://h:1/0", partitions=2, env_modules=["m", "n"])
    flags = render_flags(section)
    assert flags == [
        *("--run", "r", "--redis-url", "redis://h:1/0", "--partitions", "2"),
        "--env-modules=m,n",
    ]
    required = ["--model", "m", "--inference-urls", "http://127.0.0.1:1"]
    for role in (LearnerConfig, WorkerConfig):
        parser = argparse.ArgumentParser()
        add_flags(parser, role)
        config = role.load(flag_values(parser.parse_args([*flags, *required]), role), environ={})
        assert (config.run, config.redis_url, config.partitions) == ("r", "redis://h:1/0", 2)
        assert config.env_modules == ["m", "n"]


def test_every_run_field_a_farm_is_given_reaches_its_children() -> None:
    """A field of `RunFields` is declared once and reaches every role: each role that runs
    environments inherits it, and the farm renders all of them for its children."""
    from farm.stack import run_section
    from learner.evaluate import EvaluateConfig, FilterConfig

    for role in (LearnerConfig, WorkerConfig, EvaluateConfig, FilterConfig, FarmConfig):
        assert issubclass(role, RunFields), role
    given = {"run": "r", "partitions": 2, "env_modules": ["m"], "log_level": "DEBUG"}
    assert set(given) | {"redis_url"} == set(RunFields.model_fields)  # every field, not default
    farm = FarmConfig.load(given, environ={})
    flags = render_flags(run_section(farm, "redis://h:1/0"))
    required = ["--model", "m", "--inference-urls", "http://127.0.0.1:1"]
    for role in (LearnerConfig, WorkerConfig):
        parser = argparse.ArgumentParser()
        add_flags(parser, role)
        config = role.load(flag_values(parser.parse_args([*flags, *required]), role), environ={})
        got = {name: getattr(config, name) for name in RunFields.model_fields}
        assert got == {**given, "redis_url": "redis://h:1/0"}, role
