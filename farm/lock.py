"""The dependency locks: what they pin, and where an environment departs from them.

`locks/cpu.txt` pins, with hashes, everything the project's base and the extras of
``LOCK_EXTRAS["cpu"]`` need, with the CPU build of torch: the bootstrap (and so CI) installs
it whole, and the compose stack's CPU image the part its extras need. `locks/gpu.txt` pins the
base with ``LOCK_EXTRAS["gpu"]`` (vLLM 0.33 and the CUDA torch it requires, which cannot share
a resolution with the CPU torch): the learner image and GPU nodes (scripts/gpu_check.sh)
install it, each keeping the torch, CUDA libraries and vLLM it already has (``STACK``). Both
are universal (uv's ``--universal``): one entry per package, or several behind markers where
the platform or the python decides, so one lock serves the host's python and the images'
alike. `scripts/upgrade-deps.sh` writes them; nothing else does.

    python -m farm.lock check [--lock cpu|gpu|PATH] [--report] [--keep-stack]  # exit 1 on drift
    python -m farm.lock constraints [--lock L] [--python X.Y.Z] [--keep-stack] # pip -c lines
    python -m farm.lock requirements [--lock L] [--keep-stack]   # pip -r lines, with hashes
    python -m farm.lock diff OLD NEW                              # what an upgrade changed
"""

from __future__ import annotations

import argparse
import fnmatch
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker, default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from farm.errors import LockError
from launch.settings import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"cpu": ROOT / "locks" / "cpu.txt", "gpu": ROOT / "locks" / "gpu.txt"}
# The extras of pyproject.toml each lock resolves (scripts/upgrade-deps.sh passes the same).
LOCK_EXTRAS = {
    "cpu": ("train", "sandbox", "tracking", "data", "agent", "dev"),
    "gpu": ("train", "sandbox", "tracking", "data", "agent", "dev", "gpu"),
}
# What a GPU machine or a CUDA base image brings and keeps (--keep-stack): torch in the build
# that fits its driver, the CUDA libraries and kernels built against it, and vLLM, which pins
# torch exactly. Installing the lock's over them would swap gigabytes for a build nobody ran
# on that machine; the report names each one kept at a version other than the lock's.
STACK = (
    "torch",
    "torchvision",
    "torchaudio",
    "torchcodec",
    "triton",
    "nvidia-*",
    "cuda-*",
    "vllm",
    "flashinfer-*",
    "xformers",
)


@dataclass(frozen=True)
class Pin:
    """One entry of a lock: a package at one version, on the platforms its marker admits."""

    name: str  # canonical (PEP 503): lower case, runs of -_. as one -
    version: str
    marker: str | None  # None: every platform
    hashes: tuple[str, ...]  # "sha256:<hex>", one per file the index has for this version

    def applies(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether this entry is for the interpreter `env` describes (the running one)."""
        return self.marker is None or Marker(self.marker).evaluate(dict(env or {}))

    def requirement(self) -> str:
        """The entry as a pip requirement line without its marker, hashes included."""
        return " ".join([f"{self.name}=={self.version}", *(f"--hash={h}" for h in self.hashes)])


@dataclass(frozen=True)
class Drift:
    """A locked package whose installed version is not the locked one."""

    name: str
    locked: str
    installed: str | None  # None: not installed

    def __str__(self) -> str:
        have = f"installed {self.installed}" if self.installed else "not installed"
        return f"{self.name}: locked {self.locked}, {have}"


def _logical_lines(text: str) -> Iterable[tuple[int, str]]:
    """(first line number, line) with comments dropped and continuations joined."""
    start, parts = 0, []
    for number, raw in enumerate(text.splitlines(), 1):
        line = "" if raw.lstrip().startswith("#") else raw.split(" #", 1)[0].strip()
        if not line:
            continue
        if not parts:
            start = number
        parts.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            yield start, " ".join(parts)
            parts = []
    if parts:
        yield start, " ".join(parts)


def parse(text: str, source: str = "<lock>") -> list[Pin]:
    """The entries of a lock's text; a LockError names the line of anything else."""
    pins = []
    for number, line in _logical_lines(text):
        words = line.split()
        hashes = tuple(w.removeprefix("--hash=") for w in words if w.startswith("--hash="))
        spec = " ".join(w for w in words if not w.startswith("--hash="))
        try:
            req = Requirement(spec)
            (only,) = req.specifier
            if only.operator != "==" or "*" in only.version:
                raise ValueError("not an exact pin")
            Version(only.version)
        except (InvalidRequirement, InvalidVersion, ValueError) as exc:
            raise LockError(f"{source}:{number}: not a pinned requirement: {line!r}") from exc
        if not hashes:
            raise LockError(f"{source}:{number}: {req.name} has no --hash")
        marker = str(req.marker) if req.marker else None
        pins.append(Pin(canonicalize_name(req.name), only.version, marker, hashes))
    if not pins:
        raise LockError(f"{source}: no pinned requirement")
    return pins


def read(lock: str | Path) -> list[Pin]:
    """The entries of `lock`: "cpu", "gpu" (LOCKS) or a path."""
    path = LOCKS.get(str(lock), Path(lock))
    try:
        return parse(path.read_text(), str(path))
    except OSError as exc:
        raise LockError(f"cannot read the lock {path}: {exc}") from exc


def for_python(pins: Iterable[Pin], python_version: str | None = None) -> dict[str, Pin]:
    """The entry of each package that applies on this platform with `python_version` (the
    running interpreter's when None): what an install there takes from the lock."""
    env = default_environment()
    if python_version:
        env |= {
            "python_full_version": python_version,
            "python_version": ".".join(python_version.split(".")[:2]),
        }
    chosen: dict[str, Pin] = {}
    for pin in pins:
        if not pin.applies(env):
            continue
        if pin.name in chosen:
            first = chosen[pin.name]
            raise LockError(
                f"two entries of {pin.name} apply here: {first.version} ; {first.marker} "
                f"and {pin.version} ; {pin.marker}"
            )
        chosen[pin.name] = pin
    return chosen


def installed() -> dict[str, str]:
    """Canonical name -> version of each distribution the running interpreter imports first."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist.version)
    return found


def drift(pins: Iterable[Pin], have: Mapping[str, str] | None = None) -> list[Drift]:
    """Every locked package that applies here whose installed version (`have`, the running
    interpreter's when None) differs from the lock, or that is missing."""
    have = installed() if have is None else have
    out = []
    for name, pin in sorted(for_python(pins).items()):
        version = have.get(name)
        if version is None or Version(version) != Version(pin.version):
            out.append(Drift(name, pin.version, version))
    return out


def changes(old: Iterable[Pin], new: Iterable[Pin]) -> list[str]:
    """What moved between two locks, one line per package: ``name 1.0 -> 1.1``, ``+ name 2.0``
    (added) or ``- name 2.0`` (removed); versions behind markers are listed together."""

    def versions(pins: Iterable[Pin]) -> dict[str, str]:
        by_name: dict[str, set[str]] = {}
        for pin in pins:
            by_name.setdefault(pin.name, set()).add(pin.version)
        return {n: ", ".join(sorted(v, key=Version)) for n, v in by_name.items()}

    before, after = versions(old), versions(new)
    lines = []
    for name in sorted(before.keys() | after.keys()):
        if name not in after:
            lines.append(f"- {name} {before[name]}")
        elif name not in before:
            lines.append(f"+ {name} {after[name]}")
        elif before[name] != after[name]:
            lines.append(f"{name} {before[name]} -> {after[name]}")
    return lines


def in_stack(name: str) -> bool:
    """Whether `name` (canonical) is part of a GPU machine's own STACK."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in STACK)


def constraints(
    pins: Mapping[str, Pin], keep_stack: bool = False, have: Mapping[str, str] | None = None
) -> list[str]:
    """``name==version`` of each pin (`for_python`'s choice), for pip's ``-c``: a resolution
    under them takes the lock's version of whatever it needs. With `keep_stack`, a STACK
    package is held at the version installed here instead (`have`, the running interpreter's
    when None), and left out where none is, so the machine's own stays as it is."""
    if keep_stack and have is None:
        have = installed()
    lines = []
    for name, pin in sorted(pins.items()):
        if not (keep_stack and in_stack(name)):
            lines.append(f"{name}=={pin.version}")
        elif have and name in have:
            lines.append(f"{name}=={have[name]}")
    return lines


def _lock_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lock", default="cpu", help="cpu, gpu or a path (default cpu)")
    parser.add_argument(
        "--keep-stack",
        action="store_true",
        help="leave the machine's torch, CUDA libraries and vLLM alone (farm.lock.STACK)",
    )


def _check(args: argparse.Namespace) -> int:
    label = LOCKS.get(args.lock, args.lock)
    applies = for_python(read(args.lock))
    found = drift(applies.values())
    stack = [d for d in found if args.keep_stack and in_stack(d.name)]
    kept = [d for d in stack if d.installed]
    absent = [d for d in found if not d.installed]
    differ = [d for d in found if d.installed and d not in kept]
    python = platform.python_version()
    print(f"{label}: {len(applies)} packages apply to python {python} here, ", end="")
    print(f"{len(applies) - len(found)} at their locked versions")
    for title, items in (("kept, the machine's own (--keep-stack)", kept), ("differ", differ)):
        if items:
            print(f"{title}: {len(items)}")
            print("\n".join(f"  {item}" for item in items))
    if absent:
        print(f"not installed: {len(absent)}")
        print("\n".join(f"  {d.name} {d.locked}" + (" (stack)" * (d in stack)) for d in absent))
    failed = differ or [d for d in absent if d not in stack]
    return 0 if args.report or not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m farm.lock",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="installed versions against a lock (exit 1 on drift)")
    _lock_arguments(check)
    check.add_argument("--report", action="store_true", help="print the drift, exit 0")
    cons = sub.add_parser("constraints", help="the lock as pip constraints (name==version)")
    _lock_arguments(cons)
    cons.add_argument("--python", help="the python the pins are chosen for (default this one)")
    reqs = sub.add_parser("requirements", help="this python's pins as hashed pip requirements")
    _lock_arguments(reqs)
    diff = sub.add_parser("diff", help="what changed between two locks")
    diff.add_argument("old", type=Path)
    diff.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            return _check(args)
        if args.command == "diff":
            for line in changes(read(args.old), read(args.new)):
                print(line)
            return 0
        pins = for_python(read(args.lock), getattr(args, "python", None))
        if args.command == "constraints":
            print("\n".join(constraints(pins, args.keep_stack)))
            return 0
        chosen = [p for n, p in sorted(pins.items()) if not (args.keep_stack and in_stack(n))]
        print("\n".join(pin.requirement() for pin in chosen))
        return 0
    except LockError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
