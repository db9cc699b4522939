"""launch.settings: flat names over nested sections, precedence, errors, masking, grouped help."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from launch.runner import Role, build_parser
from launch.settings import RoleConfig, SettingsError, leaves, mask, masked, section
from learner.config import LearnerConfig
from workers.config import WorkerConfig


class Knobs(BaseModel):
    """Knobs of a component."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    speed: int = Field(1, ge=1, description="how fast")
    timeout_s: float = Field(5.0, gt=0, description="how long")


class Demo(RoleConfig):
    role: ClassVar[str] = "demo"

    url: str = Field("redis://127.0.0.1/0", description="where")
    token: SecretStr | None = Field(None, description="secret")
    log_level: str = "INFO"
    knobs: Knobs = section(Knobs, prefix="knob_", timeout_s=9.0)


def test_flat_names_come_from_the_fields_and_the_section_prefix() -> None:
    index = leaves(Demo)
    assert index["knob_speed"].path == ("knobs", "speed")
    assert index["url"].path == ("url",)
    assert {"knob_timeout_s", "token", "log_level"} <= set(index)


def test_precedence_per_leaf_and_role_defaults_of_a_section(tmp_path: Path) -> None:
    toml = tmp_path / "d.toml"
    toml.write_text('url = "redis://toml/0"\n[knobs]\nspeed = 3\n')
    cfg = Demo.load({}, toml, environ={})
    assert cfg.knobs == Knobs(speed=3, timeout_s=9.0)  # the role's 9.0 survives a partial table
    env = {"FARM_KNOB_SPEED": "4", "FARM_URL": "redis://env/0"}
    cfg = Demo.load({"knob_speed": "5"}, toml, environ=env)
    assert (cfg.url, cfg.knobs.speed, cfg.knobs.timeout_s) == ("redis://env/0", 5, 9.0)
    flat = tmp_path / "flat.toml"
    flat.write_text("knob_timeout_s = 1.5\n")
    assert Demo.load({}, flat, environ={}).knobs.timeout_s == 1.5


def test_every_problem_is_named_by_its_flat_name(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("[knobs]\nspeeed = 2\n")
    with pytest.raises(SettingsError) as info:
        Demo.load({"knob_speed": "0", "bogus": 1}, toml, environ={})
    text = str(info.value)
    assert "invalid demo configuration:" in text
    assert "knob_speed: Input should be greater than or equal to 1" in text
    assert "bogus: Extra inputs are not permitted" in text
    assert "knobs.speeed: Extra inputs are not permitted" in text
    with pytest.raises(SettingsError, match="does not exist"):
        Demo.load({}, tmp_path / "missing.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("url = \n")
    with pytest.raises(SettingsError, match="cannot read"):
        Demo.load({}, broken, environ={})


def test_a_flat_name_used_twice_is_refused() -> None:
    class Clash(RoleConfig):
        speed: int = 1
        knobs: Knobs = section(Knobs)

    with pytest.raises(TypeError, match="'speed'"):
        leaves(Clash)


def test_secrets_and_url_passwords_are_masked() -> None:
    cfg = Demo.load({"url": "rediss://alice:hunter2@redis:6380/0", "token": "tok-123"}, environ={})
    shown = str(masked(cfg))
    assert "hunter2" not in shown and "tok-123" not in shown
    assert "rediss://alice:***@redis:6380/0" in shown
    assert mask(["redis://:pw@h/0", "http://plain/"]) == ["redis://:***@h/0", "http://plain/"]
    assert cfg.token is not None and cfg.token.get_secret_value() == "tok-123"


@pytest.mark.parametrize("role", [LearnerConfig, WorkerConfig], ids=["learner", "worker"])
def test_help_groups_every_leaf_by_its_section(role: type[RoleConfig]) -> None:
    async def main(ctx: object) -> int:
        return 0

    parser = build_parser(Role("x", role, main, "x"))
    text = parser.format_help()
    for name in leaves(role):
        assert "--" + name.replace("_", "-") in text
    titles = [g.title for g in parser._action_groups]
    sections = {leaf.section for leaf in leaves(role).values() if leaf.section}
    assert sections and sections <= set(titles)
    args = parser.parse_args(["--max-turns" if role is WorkerConfig else "--max-steps", "3"])
    assert isinstance(args, argparse.Namespace)


def test_learner_and_worker_sections_take_flat_flags() -> None:
    cfg = LearnerConfig.load(
        {
            "model": "/m",
            "learning_rate": "0.5",
            "curriculum": True,
            "horizon_start": "2",
            "horizon_max": "4",
            "stale_policy": "drop",
        },
        environ={"FARM_CLIP_HIGH": "0.3"},
    )
    assert (cfg.optim.learning_rate, cfg.optim.clip_high) == (0.5, 0.3)
    assert cfg.curriculum.curriculum and cfg.horizon.at(5) == 2 and cfg.batch.drop_stale
    worker = WorkerConfig.load(
        {"model": "/m", "inference_urls": "http://a:1", "inference_api_key": "k"}, environ={}
    )
    assert worker.inference.request_timeout_s == 60.0  # the worker's default, not the client's
    assert worker.inference.api_key is not None
    assert "k" not in str(masked(worker)["inference"]["api_key"])


def test_a_comma_list_flag_may_be_repeated() -> None:
    parser = build_parser(Role("learner", LearnerConfig, main=None, description="d"))  # type: ignore[arg-type]
    args = parser.parse_args(
        ["--inference-urls", "http://a,http://b", "--inference-urls", "http://c"]
    )
    cfg = LearnerConfig.load({"model": "/m", "inference_urls": args.inference_urls}, environ={})
    assert cfg.inference_urls == ["http://a", "http://b", "http://c"]
    one = LearnerConfig.load({"model": "/m"}, environ={"FARM_INFERENCE_URLS": "http://a,http://b"})
    assert one.inference_urls == ["http://a", "http://b"]
