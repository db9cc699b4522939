"""The import layering: no package imports one above it, and no module circle.

Every import of every module counts, wherever it is written: at the top, inside a
function (a lazy import), under ``if TYPE_CHECKING:`` or in a ``try``; a lazy import
can delay a circle but not remove it. The layers, bottom first (README, "Layers"):
a module may import its own package and the packages of lower layers; packages on
one layer are independent of each other. The test reads the sources with `ast`,
so it imports nothing and covers modules no other test imports.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (  # bottom first; one line: independent packages
    ("launch",),  # the one start-up path of every role: settings, logging, runner
    ("broker", "sandbox"),  # the wire contract and Redis; isolated execution
    ("envs",),  # environments: messages from the broker, sandboxes for tools
    ("inference",),  # generation client and policy server (tool-call parsing from envs)
    ("learner", "workers"),  # the two roles of a run, which meet only through Redis
    ("farm",),  # the one-machine stack and `show`, which draws the learner's maths
    ("bench", "examples"),  # benchmarks and example plug-ins, on top of everything
)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path, packages: Sequence[str]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The dotted names one import statement loads (a module, or a module.attribute)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package, up level - 1 packages
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    for alias in node.names:
        yield f"{base}.{alias.name}"


def imports(root: Path, packages: Sequence[str]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}; `from a import b` is `a.b` when that
    is a module, else `a`. Imports of anything outside `packages` are left out."""
    known = modules(root, packages)
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(name, path, node):
                while target and target not in known:  # an attribute: its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def upward(graph: dict[str, dict[str, int]], layers: Sequence[Sequence[str]]) -> list[str]:
    """Imports of a package on the same layer or above, as readable lines."""
    rank = {package: i for i, line in enumerate(layers) for package in line}
    bad = []
    for source, targets in sorted(graph.items()):
        mine = source.split(".")[0]
        for target, line in sorted(targets.items()):
            theirs = target.split(".")[0]
            if theirs != mine and rank[theirs] >= rank[mine]:
                where = "above it" if rank[theirs] > rank[mine] else "beside it"
                bad.append(f"{source}:{line} imports {target} ({theirs} is {where})")
    return bad


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or round a loop (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def problems(root: Path, layers: Sequence[Sequence[str]]) -> list[str]:
    graph = imports(root, [p for line in layers for p in line])
    return upward(graph, layers) + [f"circle: {' <-> '.join(c)}" for c in circles(graph)]


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == {p for line in LAYERS for p in line}


def test_no_package_imports_one_above_it_and_no_module_circle():
    found = problems(ROOT, LAYERS)
    assert not found, "import layering broken:\n" + "\n".join(found)


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_check_sees_lazy_upward_imports_siblings_and_hidden_circles(tmp_path):
    _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from high.c import g\n",  # lazy, upward
            "low/b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from low.d import D
            """,
            "low/d.py": "from . import b\n",  # relative; with b: a circle
            "left/__init__.py": "from right import x\n",  # a sibling on the same layer
            "right/__init__.py": "",
            "right/x.py": "import low.a\nimport json\n",  # downward and outside: fine
            "high/__init__.py": "",
            "high/c.py": "from low import a\ng = a\n",
        },
    )
    found = problems(tmp_path, [("low",), ("left", "right"), ("high",)])
    assert found == [
        "left:1 imports right.x (right is beside it)",
        "low.a:2 imports high.c (high is above it)",
        "circle: high.c <-> low.a",  # held by the lazy import
        "circle: low.b <-> low.d",
    ]
