"""The configuration precedence every role of the farm shares.

Command-line values beat ``FARM_*`` environment variables, which beat a TOML file.
Each role owns its pydantic-settings model and its own ConfigError; this module
resolves the sources in that order and describes every problem in one message.
The broker hosts it because every role that reads ``FARM_*`` settings already
depends on the broker, and the variables (``FARM_REDIS_URL``, ``FARM_RUN``) are shared.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BeforeValidator, ValidationError
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

from broker.connection import check_redis_url

S = TypeVar("S", bound=BaseSettings)


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


# A Redis URL field, checked for a scheme the clients speak.
RedisUrl = Annotated[str, AfterValidator(check_redis_url)]
# A list field that flags and FARM_* variables give as "a,b,c" (not JSON).
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseSettings]) -> None:
    """One `--field-name` flag per field of `cls`, documented by its description."""
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=field.description)
        else:
            parser.add_argument(flag, dest=name, metavar=name.upper(), help=field.description)


class SettingsError(ValueError):
    """The settings could not be resolved; the message lists every problem."""


def resolve_settings(cls: type[S], cli: dict[str, Any], toml_file: Path | None, role: str) -> S:
    """Build `cls` from CLI values > environment > `toml_file`; raise SettingsError."""
    if toml_file is not None and not toml_file.is_file():
        raise SettingsError(f"config file {toml_file} does not exist")

    class _Resolved(cls):  # type: ignore[valid-type,misc]
        @classmethod
        def settings_customise_sources(
            cls_,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings]
            if toml_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
            return tuple(sources)

    try:
        resolved = _Resolved(**cli)
    except ValidationError as exc:
        lines = [f"invalid {role} configuration:"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(config)"
            lines.append(f"  {where}: {err['msg']}")
        raise SettingsError("\n".join(lines)) from exc
    except ValueError as exc:  # malformed TOML
        raise SettingsError(f"cannot read {toml_file}: {exc}") from exc
    return cls.model_construct(**dict(resolved))
