"""Plumbing of the offline image builds, shared by `farm.images` and `farm.plugins`.

The pins of the running environment (what the tests ran), the requirements a wheelhouse
still lacks for an image's Python, and a Docker build from a tar context whose failure
becomes an `ImageError` carrying the end of the build log.
"""

from __future__ import annotations

import io
import logging
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from farm.errors import ImageError

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)


def constraints_text() -> str:
    """Pins of every distribution in the running environment (the versions the tests ran)."""
    pins = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in ("rollout-farm", "torch"):
            pins[name.lower()] = f"{name}=={dist.version}"
    return "\n".join(sorted(pins.values())) + "\n"


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
