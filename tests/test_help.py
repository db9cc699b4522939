"""Help that helps (issue 42): every flag of every command line shows its default, choices are
listed, subcommands are named, and `farm eval --help` shows the flags it passes through.

The role parsers are built in-process (`launch.runner.build_parser`), at a width that keeps
each flag's help on one line, and every leaf of each role's config is looked up there with
the default the resolver would use."""

from __future__ import annotations

import importlib
import re

import pytest

from launch.runner import Role, build_parser
from launch.settings import leaves, shown_default

ROLES = {
    "learner": ("learner.cli", "ROLE"),
    "learner evaluate": ("learner.evaluate", "ROLE"),
    "learner filter": ("learner.evaluate", "FILTER"),
    "workers": ("workers.__main__", "ROLE"),
    "inference": ("inference.__main__", "ROLE"),
    "broker": ("broker.__main__", "ROLE"),
}


def _role(name: str) -> Role:
    module, attribute = ROLES[name]
    return getattr(importlib.import_module(module), attribute)


def _one_line_help(monkeypatch: pytest.MonkeyPatch, text_of: object) -> str:
    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps at the terminal's width
    return text_of()  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(ROLES))
def test_every_config_field_is_in_help_with_its_default(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    role = _role(name)
    text = _one_line_help(monkeypatch, build_parser(role).format_help)
    for flat, leaf in leaves(role.config).items():
        flag = "--" + str((leaf.field.json_schema_extra or {}).get("flag", flat)).replace("_", "-")
        entry = _entry(text, flag)
        assert entry is not None, f"{name}: {flag} is not in --help"
        assert f"(default: {shown_default(role.config, leaf)})" in entry, entry


def _entry(text: str, flag: str) -> str | None:
    """A flag's entry in --help: its line and the help lines under it, joined."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"\s+{re.escape(flag)}([ ,=]|$)", line):
            rest = [x for x in lines[i + 1 :]]
            end = next((n for n, x in enumerate(rest) if not x.startswith(" " * 6)), len(rest))
            return " ".join([line, *(x.strip() for x in rest[:end])])
    return None


def test_defaults_are_the_roles_own_and_choices_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _one_line_help(monkeypatch, build_parser(_role("learner")).format_help)
    algorithm = _entry(text, "--algorithm") or ""
    assert "{grpo,rebn,rloo,reinforce,reinforce++,reinforce++-baseline,ppo}" in algorithm
    assert algorithm.endswith("(default: grpo)")
    # a section's role default, not the component's: the learner's consumer reclaims late
    assert "(default: 3600.0)" in (_entry(text, "--reclaim-idle-s") or "")
    assert "(default: required)" in (_entry(text, "--model") or "")
    assert "(default: none)" in (_entry(text, "--inference-api-key") or "")
    assert "(default: false)" in (_entry(text, "--resume") or "")


def test_learner_help_names_its_subcommands(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _one_line_help(monkeypatch, build_parser(_role("learner")).format_help)
    assert "python -m learner evaluate" in text and "python -m learner filter" in text


def test_farm_help_shows_defaults_and_eval_shows_the_flags_it_passes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from farm.cli import parser

    monkeypatch.setenv("COLUMNS", "100000")
    root = parser()
    subs = next(a for a in root._actions if a.dest == "command").choices  # type: ignore[attr-defined]
    up = subs["up"].format_help()
    assert re.search(r"--workers WORKERS\s+worker processes \(default: 2\)", up)
    assert re.search(r"--stop-when-solved, --no-stop-when-solved\s+.*\(default: false\)", up)
    assert re.search(r"--quiet\s+.*\(default: False\)", up)
    evaluate = subs["eval"].format_help()
    assert "flags of `python -m learner evaluate`, passed through:" in evaluate
    assert re.search(r"--eval-tasks EVAL_TASKS\s+.*\(repeatable\) \(default: none\)", evaluate)
    assert "--keep" in subs["filter"].format_help()
    status = subs["status"].format_help()
    assert re.search(r"--watch WATCH\s+repeat every N seconds \(default: 0.0\)", status)


def test_every_benchmark_help_shows_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.__main__ import available

    monkeypatch.setenv("COLUMNS", "100000")
    for name in available():
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"bench.{name}").main(["--help"])
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and "(default: " in out, name
