"""How a role's configuration is resolved: one resolver, derived flags, masked logging.

A role config (`RoleConfig`) is a pydantic model whose fields are either leaves (one
value) or sections: the config model of a component, which that component takes as
is (a pydantic model or pydantic dataclass). Every leaf has one *flat name*, unique
within the role: the section's prefix, if it has one, plus the field name. From the
field come, without being spelled again anywhere:

- the flag ``--flat-name`` (grouped under its section's title in ``--help``;
  booleans also get ``--no-flat-name``; a `CommaList`'s flag may be repeated);
- the environment variable ``<ENV_PREFIX>FLAT_NAME`` (``FARM_`` for most roles);
- the TOML key: ``flat_name = ...`` at top level, or ``field = ...`` inside the
  section's table (``[optim]``).

Precedence, leaf by leaf: flags > environment > TOML > the role's default, which may
set a section's defaults apart from the component's own (``section(..., x=1)``).
`resolve` builds the model and reports every problem in one `SettingsError`.

Adding a component config to a role is one line in the role's model::

    optim: OptimConfig = section(OptimConfig)  # --learning-rate, FARM_LEARNING_RATE
    inference: ClientConfig = section(ClientConfig, prefix="inference_", timeout_s=60.0)

The component's fields then become flags, variables and keys of that role; a flat
name used twice within a role is a `TypeError` at the first resolve. Sections nest
one level. Secrets are `SecretStr` fields; `masked` renders a config for the log
with those and every password inside a URL hidden. `render_flags` is the resolver's
inverse: a config as the flags that resolve back to it, for a process that starts
another role (`farm`). A field may rename its flag (``json_schema_extra={"flag": ...}``),
add aliases (``{"flag_aliases": [...]}``) or say how ``--help`` shows a default made
afresh each time (``{"help_default": "HOST-RANDOM"}``; every other default is shown as is);
a plain list's flag is repeated, one item each, items kept whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode

C = TypeVar("C", bound="RoleConfig")
Path_ = tuple[str, ...]

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]


def split_commas(value: Any) -> Any:
    """Split "a,b" into ["a", "b"]; a list (a repeated flag, a TOML array) item by item."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [item for v in value for item in split_commas(v)]
    return value


# A list field that flags and environment variables give as "a,b,c" (not JSON); its flag
# may also be repeated (--x a --x b).
CommaList = Annotated[list[str], NoDecode, BeforeValidator(split_commas)]


class SettingsError(ValueError):
    """The settings could not be resolved; the message lists every problem."""


class RoleConfig(BaseModel):
    """Base of every role's config: unknown keys rejected, defaults validated."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    role: ClassVar[str] = "role"  # named in error messages and logs
    env_prefix: ClassVar[str] = "FARM_"  # environment variables are <env_prefix>FLAT_NAME
    toml_table: ClassVar[str | None] = None  # a TOML table the role's keys may sit under
    error: ClassVar[type[Exception]] = SettingsError  # what `load` raises

    @classmethod
    def load(
        cls: type[C],
        cli: Mapping[str, Any],
        toml_file: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> C:
        """Resolve flags > environment > TOML; raise the role's error listing every problem."""
        try:
            return resolve(cls, cli, toml_file, environ)
        except SettingsError as exc:
            raise cls.error(str(exc)) from exc


def section(component: type, *, prefix: str = "", **defaults: Any) -> Any:
    """A role field holding `component`'s config; `defaults` are this role's own."""
    doc = (component.__doc__ or component.__name__).strip().splitlines()[0].rstrip(".")
    return Field(
        default_factory=lambda: component(**defaults),
        description=doc,
        json_schema_extra={"flag_prefix": prefix},
    )


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One settable value of a role config."""

    name: str  # flat name: flag, variable and top-level TOML key
    path: Path_  # attribute path inside the role config
    field: FieldInfo
    section: str  # title of its section in --help ("" at top level)


def fields_of(model: type) -> dict[str, FieldInfo]:
    """The pydantic fields of a model or pydantic dataclass."""
    return dict(model.__pydantic_fields__)  # type: ignore[attr-defined]


def section_type(field: FieldInfo) -> type | None:
    """The component config type a field holds, or None for a leaf."""
    kind = field.annotation
    if isinstance(kind, type) and (issubclass(kind, BaseModel) or is_pydantic_dataclass(kind)):
        return kind
    return None


@functools.cache
def leaves(model: type) -> dict[str, Leaf]:
    """Every leaf of `model` by flat name; TypeError when two share a name."""
    found: dict[str, Leaf] = {}

    def add(leaf: Leaf) -> None:
        if leaf.name in found:
            raise TypeError(f"{model.__name__}: two fields are named {leaf.name!r}")
        found[leaf.name] = leaf

    for name, field in fields_of(model).items():
        sub = section_type(field)
        if sub is None:
            add(Leaf(name, (name,), field, ""))
            continue
        prefix = str(_extra(field).get("flag_prefix", ""))
        title = f"{name}: {field.description or sub.__name__}"
        for inner, inner_field in fields_of(sub).items():
            add(Leaf(prefix + inner, (name, inner), inner_field, title))
    return found


def resolve(
    cls: type[C],
    cli: Mapping[str, Any],
    toml_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> C:
    """Build `cls` from `cli` (flat names; None means unset) > environment > TOML."""
    index = leaves(cls)
    given: dict[Path_, Any] = {}
    if toml_file is not None:
        given.update(_toml_values(cls, index, toml_file))
    env = os.environ if environ is None else environ
    for leaf in index.values():
        raw = env.get(cls.env_prefix + leaf.name.upper())
        if raw is not None:
            given[leaf.path] = _env_value(cls.env_prefix + leaf.name.upper(), raw, leaf.field)
    for name, value in cli.items():
        if value is not None:
            given[index[name].path if name in index else (name,)] = value
    try:
        return cls.model_validate(_nest(cls, given))
    except ValidationError as exc:
        raise SettingsError(_describe(cls, index, exc)) from exc


def _toml_values(cls: type[RoleConfig], index: dict[str, Leaf], path: Path) -> dict[Path_, Any]:
    if not path.is_file():
        raise SettingsError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise SettingsError(f"cannot read {path}: {exc}") from exc
    if cls.toml_table and isinstance(data.get(cls.toml_table), dict):
        data = data[cls.toml_table]
    sections = {n for n, f in fields_of(cls).items() if section_type(f) is not None}
    values: dict[Path_, Any] = {}
    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            values.update({(key, inner): v for inner, v in value.items()})
        else:
            values[index[key].path if key in index else (key,)] = value
    return values


def _comma_list(field: FieldInfo) -> bool:
    return any(isinstance(m, NoDecode) or m is NoDecode for m in field.metadata)


def _env_value(variable: str, raw: str, field: FieldInfo) -> Any:
    """A variable's text as the field wants it: JSON for lists and maps, else the text."""
    if _comma_list(field):
        return raw
    kinds = {
        typing.get_origin(a) or a for a in (field.annotation, *typing.get_args(field.annotation))
    }
    if kinds & {list, dict, tuple, set}:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{variable}: not valid JSON ({exc})") from exc
    return raw


def _nest(model: type, given: dict[Path_, Any]) -> dict[str, Any]:
    """Per-path values as the nested dict the model validates; sections keep role defaults."""
    fields = fields_of(model)
    out: dict[str, Any] = {}
    for path, value in given.items():
        if len(path) == 1:
            out[path[0]] = value
    for name, field in fields.items():
        inner = {p[1:]: v for p, v in given.items() if len(p) > 1 and p[0] == name}
        if not inner or section_type(field) is None:
            continue
        base = (
            _shallow(field.get_default(call_default_factory=True))
            if not field.is_required()
            else {}
        )
        out[name] = {**base, **{p[0]: v for p, v in inner.items()}}
    for path, value in given.items():  # keys under an unknown table: reported as extra inputs
        if len(path) > 1 and path[0] not in fields:
            out.setdefault(path[0], {})[path[1]] = value
    return out


def _shallow(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in fields_of(type(value))}


def _describe(cls: type, index: dict[str, Leaf], exc: ValidationError) -> str:
    by_path = {leaf.path: name for name, leaf in index.items()}
    role = getattr(cls, "role", cls.__name__)
    lines = [f"invalid {role} configuration:"]
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        where = next(
            (by_path[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in by_path),
            ".".join(loc) or "(config)",
        )
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def flag(name: str, field: FieldInfo) -> str:
    """A leaf's flag: ``--flat-name``, or the one its field names (``flag="learner-arg"``)."""
    return "--" + str(_extra(field).get("flag", name)).replace("_", "-")


def _verbatim_list(field: FieldInfo) -> bool:
    """A list with no comma form: its flag is repeated, one item each, items kept whole."""
    return not _comma_list(field) and typing.get_origin(field.annotation) is list


def add_flags(
    parser: argparse.ArgumentParser, cls: type, only: frozenset[str] | None = None
) -> None:
    """One flag per leaf of `cls` (or of those named in `only`), grouped by section.

    A field's ``json_schema_extra`` may rename its flag (``{"flag": "learner-arg"}``) and
    give aliases (``{"flag_aliases": ["env"]}``); its description is the help, followed by
    the role's default (``(default: 8)``); an enum's or Literal's choices are its metavar.
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, leaf in leaves(cls).items():
        if only is not None and name not in only:
            continue
        target: Any = parser
        if leaf.section:
            if leaf.section not in groups:
                groups[leaf.section] = parser.add_argument_group(leaf.section)
            target = groups[leaf.section]
        flags = [flag(name, leaf.field)]
        flags += ["--" + a.replace("_", "-") for a in _extra(leaf.field).get("flag_aliases", ())]
        help_ = (leaf.field.description or "").replace("%", "%%")
        shown = f"(default: {shown_default(cls, leaf)})".replace("%", "%%")
        choices = _choices(leaf.field.annotation)
        metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
        if leaf.field.annotation is bool:
            action = argparse.BooleanOptionalAction
            target.add_argument(*flags, dest=name, action=action, help=f"{help_} {shown}")
        elif _comma_list(leaf.field) or _verbatim_list(leaf.field):  # repeatable
            target.add_argument(
                *flags,
                dest=name,
                metavar=metavar,
                action="append",
                help=f"{help_} (repeatable) {shown}",
            )
        else:
            target.add_argument(*flags, dest=name, metavar=metavar, help=f"{help_} {shown}")


def shown_default(cls: type, leaf: Leaf) -> str:
    """A leaf's default in role `cls` as ``--help`` shows it (secrets and URL passwords hidden)."""
    if "help_default" in _extra(leaf.field):  # a default made afresh each time (an id)
        return str(_extra(leaf.field)["help_default"])
    value = _default(cls, leaf)
    if value is _REQUIRED:
        return "required"
    if isinstance(value, SecretStr):
        return "**********"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple | set):
        return ",".join(_text(v) for v in value) or "none"
    if isinstance(value, dict):
        return json.dumps(value) if value else "none"
    return "none" if value is None else str(mask(_text(value)))


def _choices(annotation: Any) -> list[str]:
    """The values a Literal or an enum (optional or not) allows, else []."""
    kinds = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is Literal:
        return [str(a) for a in typing.get_args(kinds[0])]
    if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], enum.Enum):
        return [str(m.value) for m in kinds[0]]
    return []


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every CLI's ``--help``: each flag's default (unless its help already names one) and
    descriptions and epilogs as written (module docstrings keep their layout)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_ = action.help or ""
        if "default" in help_ or action.default is argparse.SUPPRESS:
            return help_
        if action.default is None and action.option_strings:
            return f"{help_} (default: none)"
        return super()._get_help_string(action)


def helpful(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` and every subcommand's parser, at any depth, with `HelpFormatter`."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                helpful(sub)
    return parser


def render_flags(config: BaseModel, *, changed_only: bool = True) -> list[str]:
    """`config` as the flags `resolve` reads back to the same config (the resolver's inverse).

    With `changed_only`, a leaf equal to its default is left out: the child resolves the
    same default (a default None is always left out: it has no flag). Secrets are written in clear (the child must get them); a None that is
    not the default, and a list without a comma form, have no flag and raise TypeError.
    """
    out: list[str] = []
    for name, leaf in leaves(type(config)).items():
        value: Any = config
        for part in leaf.path:
            value = getattr(value, part)
        default = _default(type(config), leaf)
        if (changed_only or value is None) and value == default:
            continue
        name_ = flag(name, leaf.field)
        if isinstance(value, bool):
            out.append(name_ if value else "--no-" + name_[2:])
        elif value is None:
            raise TypeError(f"{name}: None has no flag form (only a default None does)")
        elif _verbatim_list(leaf.field):
            out += [f"{name_}={_text(v)}" for v in value]
        elif isinstance(value, list | tuple | set | dict):
            if not _comma_list(leaf.field) or any("," in str(v) for v in value):
                raise TypeError(f"{name}: {value!r} has no comma-separated flag form")
            out.append(f"{name_}={','.join(_text(v) for v in value)}")
        else:
            out += [name_, _text(value)]
    return out


def _default(cls: type, leaf: Leaf) -> Any:
    """A leaf's default in role `cls` (a section's role defaults included); required: a marker."""
    top = fields_of(cls)[leaf.path[0]]
    if top.is_required():
        return _REQUIRED
    value = top.get_default(call_default_factory=True)
    return getattr(value, leaf.path[1]) if len(leaf.path) > 1 else value


_REQUIRED = object()


def _text(value: Any) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The config values among parsed arguments (flags given on the command line)."""
    return {name: getattr(args, name) for name in leaves(cls) if hasattr(args, name)}


# scheme://user:password@host -> scheme://user:***@host
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s/]+@")


def mask(value: Any) -> Any:
    """`value` with every password inside a URL replaced by ***, in strings, lists and maps."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(r"\g<head>***@", value)
    if isinstance(value, list | tuple):
        return [mask(v) for v in value]
    if isinstance(value, dict):
        return {k: mask(v) for k, v in value.items()}
    return value


def masked(config: BaseModel) -> dict[str, Any]:
    """The config as JSON-ready data for the start-up log: SecretStr and URL passwords hidden."""
    return mask(config.model_dump(mode="json"))
