"""launch.settings.render_flags: a config rendered to flags resolves back to itself."""

from __future__ import annotations

import argparse
import enum
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from launch.settings import CommaList, RoleConfig, add_flags, flag_values, render_flags, resolve
from launch.settings import section as section_


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


class Part(BaseModel):
    """A component's knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    depth: int = Field(3, ge=1, description="how deep")
    fine: bool = Field(True, description="a boolean defaulting to true")


class Role(RoleConfig):
    role: ClassVar[str] = "render"

    name: str = Field("a", description="a string")
    path: Path = Field(description="required: always rendered")
    ratio: float = Field(0.5, description="a float")
    verbose: bool = Field(False, description="a boolean")
    mode: Mode = Field(Mode.FAST, description="an enum")
    items: CommaList = Field(default_factory=list, description="a comma list")
    extra: list[str] = Field(
        default_factory=list, description="verbatim items", json_schema_extra={"flag": "extra-arg"}
    )
    token: SecretStr | None = Field(None, description="a secret")
    limit: int | None = Field(None, description="None means no limit")
    part: Part = section_(Part, prefix="part_", depth=5)


def _round_trip(config: Role, **kwargs: Any) -> Role:
    parser = argparse.ArgumentParser()
    add_flags(parser, Role)
    args = parser.parse_args(render_flags(config, **kwargs))
    return resolve(Role, flag_values(args, Role), environ={})


def test_every_kind_of_value_round_trips() -> None:
    config = Role(
        name="b",
        path=Path("/tmp/x"),
        ratio=0.125,
        verbose=True,
        mode=Mode.SLOW,
        items=["x", "y"],
        extra=["--tracker=a,b", "--k v"],
        token=SecretStr("s3cret"),
        limit=7,
        part=Part(depth=1, fine=False),
    )
    assert _round_trip(config) == config
    assert _round_trip(config, changed_only=False) == config


def test_defaults_are_left_out_and_still_round_trip() -> None:
    config = Role(path=Path("p"))
    assert render_flags(config) == ["--path", "p"]  # the role's own section default (5) too
    assert _round_trip(config) == config


def test_false_booleans_render_as_no_flags_and_secrets_in_clear() -> None:
    flags = render_flags(Role(path=Path("p"), part=Part(fine=False), token=SecretStr("t")))
    assert "--no-part-fine" in flags
    assert flags[flags.index("--token") + 1] == "t"


def test_an_empty_list_round_trips_when_it_is_not_the_default() -> None:
    config = Role(path=Path("p"), items=[])
    assert _round_trip(config, changed_only=False) == config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Role.model_construct(path=Path("p"), part=Part(), name=None), "name: None"),
        (
            Role.model_construct(path=Path("p"), part=Part(), items=["a,b"]),
            "items: ['a,b'] has no comma",
        ),
    ],
)
def test_values_without_a_flag_form_are_refused(config: Role, message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        render_flags(config)
