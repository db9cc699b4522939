"""Plumbing of the offline image builds, shared by `farm.images` and `farm.plugins`.

The pins of the CPU lock (locks/cpu.txt, what the tests ran) for an image's Python, the
requirements a wheelhouse still lacks for it, the wheelhouse as hashed requirements checked
against the lock, and a Docker build from a tar context whose failure becomes an `ImageError`
carrying the end of the build log.
"""

from __future__ import annotations

import io
import logging
import tarfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from farm import lock
from farm.errors import ImageError

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)


def locked(python_version: str) -> dict[str, lock.Pin]:
    """The CPU lock's entry of each package for an image whose python is `python_version`."""
    return lock.for_python(lock.read("cpu"), python_version)


def constraints_text(python_version: str) -> str:
    """Pip constraints: the CPU lock's version of every package, for `python_version`."""
    return "\n".join(lock.constraints(locked(python_version))) + "\n"


def locked_requirements(into: Path, python_version: str) -> str:
    """The wheels in `into` as the lock's lines, hashes included (an image installs them
    with ``--require-hashes --no-deps``); an `ImageError` names a wheel the lock lacks."""
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    pins = locked(python_version)
    lines = []
    for wheel in sorted(into.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        pin = pins.get(name)
        if pin is None or Version(pin.version) != version:
            where = f"at {pin.version}" if pin else "not at all"
            raise ImageError(
                f"{wheel.name}: locks/cpu.txt has {name} {where} for python {python_version}; "
                "relock (scripts/upgrade-deps.sh --keep) after changing what the image needs"
            )
        lines.append(pin.requirement())
    return "\n".join(lines) + "\n"


def unmet(into: Path, python_version: str, have: set[str] | None = None) -> list[str]:
    """Requirements of the wheels in `into` that apply on `python_version` and neither a wheel
    there nor a distribution named in `have` (installed already) meets."""
    from email.parser import Parser

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    env = {
        **default_environment(),
        "python_full_version": python_version,
        "python_version": ".".join(python_version.split(".")[:2]),
        "extra": "",
    }
    wheels = sorted(into.glob("*.whl"))
    have = {canonicalize_name(n) for n in have or ()} | {
        canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels
    }
    needed: set[str] = set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(zf.read(name).decode(errors="replace"))
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if canonicalize_name(req.name) in have:
                continue
            if req.marker is None or req.marker.evaluate(env):
                req.marker = None
                needed.add(str(req))
    return sorted(needed)


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def build_image(client: DockerClient, tag: str, context: Path, buildargs: dict[str, str]) -> None:
    from docker.errors import BuildError

    log.info("building %s", tag)
    try:
        with context.open("rb") as fileobj:
            client.images.build(
                fileobj=fileobj,
                custom_context=True,
                tag=tag,
                rm=True,
                forcerm=True,
                buildargs=buildargs,
            )
    except BuildError as exc:
        tail = "".join(str(c.get("stream", c.get("error", ""))) for c in exc.build_log)[-3000:]
        raise ImageError(f"building {tag} failed: {exc}\n{tail}") from exc


def missing(client: DockerClient, tag: str, force: bool) -> bool:
    from docker.errors import ImageNotFound

    if force:
        return True
    try:
        client.images.get(tag)
        return False
    except ImageNotFound:
        return True
