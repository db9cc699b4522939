"""The registry: spec strings, clear errors, user-registered environments."""

from __future__ import annotations

import uuid

import pydantic
import pytest

import envs
from envs.errors import EnvSpecError
from envs.registry import spec_config


class Counter:
    """A user-defined environment living outside the envs package."""

    def __init__(self, target: int = 3, sandbox: object = None) -> None:
        self.target = target
        self.sandbox = sandbox
        self.n = 0

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.n = 0
        return "count", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.n += 1
        done = self.n >= self.target
        return str(self.n), float(done), done, False, {}


def _name() -> str:
    return f"user-counter-{uuid.uuid4().hex[:8]}"


async def test_user_env_registered_from_outside_runs_through_registry() -> None:
    name = _name()
    envs.register(name, Counter)
    assert name in envs.registered()
    pool = object()
    env = envs.make(f'{name}@{{"target": 2}}', sandbox=pool)
    assert env.sandbox is pool and env.target == 2
    await envs.areset(env, seed=0)
    assert (await envs.astep(env, "a"))[1:3] == (0.0, False)
    assert (await envs.astep(env, "a"))[1:3] == (1.0, True)


def test_builtins_listed() -> None:
    assert "toy" in envs.registered()


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("nope", "unknown environment 'nope'"),
        ("toy@{bad json", "not valid JSON"),
        ("toy@[1, 2]", "must be a JSON object"),
        ('toy@{"colour": 1}', "bad kwargs for 'toy'"),
        ('toy@{"difficulty": 9}', "less than or equal to 3"),
        ('toy@{"difficulty": "hard"}', "bad kwargs"),
        ("", "non-empty"),
        ('toy@{"sandbox": 1}', "'sandbox' cannot be given"),
    ],
)
def test_bad_specs_raise_clear_errors(spec: str, fragment: str) -> None:
    with pytest.raises(EnvSpecError, match=fragment.replace("[", r"\[")):
        envs.make(spec)


def test_register_rejects_duplicates_and_bad_names() -> None:
    name = _name()
    envs.register(name, Counter)
    with pytest.raises(EnvSpecError, match="already registered"):
        envs.register(name, Counter)
    envs.register(name, Counter, overwrite=True)
    with pytest.raises(EnvSpecError, match="invalid environment name"):
        envs.register("bad@name", Counter)
    with pytest.raises(EnvSpecError, match="must be callable"):
        envs.register(_name(), 42)  # type: ignore[arg-type]


def test_lazy_factory_path_that_does_not_load_is_a_spec_error() -> None:
    name = _name()
    envs.register(name, "envs.no_such_module:make")
    with pytest.raises(EnvSpecError, match="could not be loaded"):
        envs.make(name)


def test_spec_without_kwargs_and_sandbox_ignored_when_not_taken() -> None:
    env = envs.make("toy", sandbox=object())
    assert env.config.difficulty == 0
    assert envs.parse_spec(' toy @{"difficulty": 1}') == ("toy", {"difficulty": 1})


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("nope", ["unknown environment 'nope'", "registered: agent, arith, calc, code, codegym"]),
        ("toy@{bad json", ["not valid JSON"]),
        ("codegym", ["missing a required argument: 'env'", "accepted kwargs: env (required)"]),
        (
            'codegym@{"env": "max_subarray", "tool_timeout_s": 0}',
            ["tool_timeout_s: Input should be greater than 0", "max_output_chars"],
        ),
        ('codegym@{"env": "x", "colour": 1}', ["colour: Extra inputs", "config_index"]),
        ('toy@{"difficulty": 9}', ["difficulty: Input should be less than or equal to 3"]),
        ('http@{"timeout_s": 1}', ["missing a required argument: 'url'", "url (required)"]),
    ],
)
def test_check_spec_names_the_problem_and_accepted_kwargs_in_one_line(
    spec: str, fragments: list[str]
) -> None:
    with pytest.raises(EnvSpecError) as caught:
        envs.check_spec(spec)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_check_spec_builds_nothing() -> None:
    built: list[dict] = []
    name = _name()

    class Model(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        size: int = pydantic.Field(1, ge=1)

    @spec_config(Model)
    def factory(**kwargs: int) -> Counter:
        built.append(kwargs)
        return Counter()

    envs.register(name, factory)
    assert envs.check_spec(f'{name}@{{"size": 3}}') == (name, {"size": 3})
    with pytest.raises(EnvSpecError, match="size: Input should be greater than or equal to 1"):
        envs.check_spec(f'{name}@{{"size": 0}}')
    assert built == []
    # codegym validates its kwargs without a sandbox pool (make would need one)
    assert envs.check_spec('codegym@{"env": "max_subarray"}')[0] == "codegym"
