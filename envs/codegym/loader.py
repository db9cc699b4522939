"""Admitting user-provided CodeGym environments from a directory of source files.

A source is admitted only after it (1) parses and statically has one
``CodeGymEnv`` subclass with literal ``CONFIGS`` (read with ``ast``, never run on
the host), (2) instantiates in the sandbox with every config within the time
limit, and (3) where it defines an oracle ``solve()``, solves every config
(``Done`` with reward 1). Everything else is rejected with the reason; a hostile
or broken file costs at most its time limits and never stops the loader.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from envs.codegym.runner import run_request
from envs.codegym.sources import CodeGymSource, SourceError, add_source, read_source, runtime_source
from envs.sandboxed import SandboxPool, open_session


@dataclass
class LoadReport:
    """Which sources were admitted, and why the others were not."""

    admitted: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # file name -> reason


async def _validate(pool: SandboxPool, source: CodeGymSource, limit_s: float) -> str | None:
    """Return why ``source`` fails in the sandbox, or None when it proves itself."""
    files = {"codegym_runtime.py": runtime_source(), f"{source.name}.py": source.source}
    base = {"module": source.name, "class": source.class_name}
    async with open_session(pool) as sb:
        for index, config in enumerate(source.configs):
            init = await run_request(
                sb,
                {**base, "op": "init", "config": config},
                state=None,
                limit_s=limit_s,
                files=files,
            )
            files = {}  # shipped once per session
            if not init.ok:
                return f"config {index} does not instantiate: {init.problem}"
            if not source.has_solve:
                continue
            state = json.dumps(init.data["state"])
            solved = await run_request(sb, {**base, "op": "solve"}, state=state, limit_s=limit_s)
            if not solved.ok:
                return f"solve() on config {index} failed: {solved.problem}"
            if not (solved.data.get("done") and solved.data.get("reward") == 1.0):
                return f"solve() on config {index} did not reach a correct Done"
    return None


def _scan(path: str | Path) -> list[tuple[str, CodeGymSource | str]]:
    """Read and statically check every ``*.py``: a source, or the reason it is rejected."""
    found: list[tuple[str, CodeGymSource | str]] = []
    for file in sorted(p for p in Path(path).glob("*.py") if not p.name.startswith("_")):
        try:
            found.append((file.name, read_source(file.stem, file.read_text(encoding="utf-8"))))
        except (SourceError, UnicodeDecodeError, OSError) as exc:
            found.append((file.name, str(exc)))
    return found


async def load_directory(
    path: str | Path, pool: SandboxPool, *, limit_s: float = 5.0
) -> LoadReport:
    """Validate every ``*.py`` in ``path`` and add the admitted ones to the codegym library."""
    report = LoadReport()
    for file_name, source in await asyncio.to_thread(_scan, path):
        if isinstance(source, str):
            report.rejected[file_name] = source
            continue
        problem = await _validate(pool, source, limit_s)
        if problem is None:
            try:
                add_source(source)
            except SourceError as exc:
                problem = str(exc)
        if problem is None:
            report.admitted.append(source.name)
        else:
            report.rejected[file_name] = problem
    return report
