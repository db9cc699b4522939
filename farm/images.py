"""Offline build of the compose stack's images, each tagged by a hash of what it is made of.

No registry is reachable, so nothing is pulled. Every image starts from the sandbox image's
debootstrap base (`sandbox.image.ensure_base`):

- ``rollout-farm/python``: Debian's python3 plus a virtual environment with the project's
  dependencies (its base and ``EXTRAS``) at the versions locks/cpu.txt pins for that python:
  `pip download` fills a wheelhouse on the host (from the package index the host reaches,
  under the lock's pins as constraints, torch the CPU wheel in FARM_TORCH_FIND_LINKS), every
  wheel must be the lock's, and the image installs them with the lock's hashes
  (``--require-hashes --no-deps``, no index);
- ``rollout-farm/worker``: the project on top of it (workers, CPU policy server, learner);
- ``rollout-farm/redis`` and ``rollout-farm/prometheus``: Debian's packages from the apt
  mirror that the base names.

A tag exists only once its build succeeded, so `build` skips every image whose tag is
present: a second run costs a few hashes, and a source change rebuilds only the worker
layer. `build` writes the tags into an env file that docker-compose reads. ``--with PATH``
(repeatable) adds the user's own packages to the worker image, and to a learner image given
with ``--learner-image``, as one more layer (`farm.plugins`); the env file then names those.

    farm images build [--with PATH ...] [--learner-image IMAGE] [--env-file deploy/compose/.env]
                      [--quiet] [--force]
    farm images tags
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from farm import lock
from farm.errors import ImageError
from farm.image_build import (
    add_bytes,
    build_image,
    constraints_text,
    locked_requirements,
    missing,
    unmet,
)

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ROOT / "deploy" / "docker"
ENV_FILE = ROOT / "deploy" / "compose" / ".env"
# data: Parquet datasets and --reward math; agent: the openai SDK agents (and examples/) use
EXTRAS = ("train", "sandbox", "data", "agent")
# Installed beside them: pip itself, and setuptools, which builds the project in the worker
# layer (--no-build-isolation: nothing is fetched there). The lock pins both.
TOOLS = ("pip", "setuptools")
# What the worker image copies (worker.Dockerfile); the tag hashes exactly these files.
SOURCES = (
    "pyproject.toml",
    "README.md",
    "broker",
    "workers",
    "envs",
    "sandbox",
    "inference",
    "learner",
    "farm",
    "bench",
    "launch",
    "examples",  # the agent specs the docs name (`examples.code_tool_agent:solve`)
)


@dataclass(frozen=True)
class Image:
    """One image of the stack: its compose variable, repository and Dockerfile."""

    variable: str  # env-file variable the compose file reads the tag from
    repository: str
    dockerfile: str  # file name under deploy/docker


PYTHON = Image("FARM_PYTHON_IMAGE", "rollout-farm/python", "python.Dockerfile")
WORKER = Image("FARM_WORKER_IMAGE", "rollout-farm/worker", "worker.Dockerfile")
REDIS = Image("FARM_REDIS_IMAGE", "rollout-farm/redis", "redis.Dockerfile")
PROMETHEUS = Image("FARM_PROMETHEUS_IMAGE", "rollout-farm/prometheus", "prometheus.Dockerfile")
# Built elsewhere (it needs a registry); here only given plug-ins (--learner-image).
LEARNER = Image("FARM_LEARNER_IMAGE", "rollout-farm/learner", "learner.Dockerfile")


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def requirements() -> list[str]:
    """The project's runtime requirements (with EXTRAS) and TOOLS: the lock gives versions."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for e in EXTRAS for r in project["optional-dependencies"][e]]
    return [*project["dependencies"], *extras, *TOOLS]


def torch_links() -> str:
    """Where pip finds the CPU torch the lock pins (as scripts/bootstrap.sh looks)."""
    given = os.environ.get("FARM_TORCH_FIND_LINKS")
    if given:
        return given
    if Path("/opt/wheels").is_dir():
        return "/opt/wheels"
    return "https://download.pytorch.org/whl/cpu/torch/"


def source_files() -> Iterator[Path]:
    """The files of SOURCES, sorted, without bytecode."""
    for name in SOURCES:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        yield from (f for f in files if "__pycache__" not in f.parts and f.suffix != ".pyc")


def tags(base: str) -> dict[Image, str]:
    """The content tag of every image, given the base image's tag."""
    text = {
        i: (DOCKERFILES / i.dockerfile).read_bytes() for i in (PYTHON, WORKER, REDIS, PROMETHEUS)
    }
    recipe = "\n".join(requirements()).encode()
    python = _digest(base.encode(), text[PYTHON], recipe, lock.LOCKS["cpu"].read_bytes())
    python_tag = f"{PYTHON.repository}:{python}"
    sources = [str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() for f in source_files()]
    return {
        PYTHON: python_tag,
        WORKER: f"{WORKER.repository}:{_digest(python_tag.encode(), text[WORKER], *sources)}",
        REDIS: f"{REDIS.repository}:{_digest(base.encode(), text[REDIS])}",
        PROMETHEUS: f"{PROMETHEUS.repository}:{_digest(base.encode(), text[PROMETHEUS])}",
    }


def wheelhouse(into: Path, python_version: str, quiet: bool) -> None:
    """Download every wheel the python image installs into `into`, at the lock's versions,
    and write them as hashed requirements (requirements.txt) for the image's `python_version`.

    pip evaluates dependency markers for the interpreter it runs on, not for the image's
    (`--python-version` does not change that), so a dependency behind a marker such as
    ``python_full_version < "3.11.3"`` is downloaded in further rounds until the
    wheelhouse is closed for the image's `python_version`.
    """
    constraints = into.parent / "constraints.txt"
    constraints.write_text(constraints_text(python_version))
    wanted = requirements()
    for _ in range(5):
        _pip_download(into, constraints, wanted, quiet)
        wanted = unmet(into, python_version)
        if not wanted:
            (into / "requirements.txt").write_text(locked_requirements(into, python_version))
            return
        log.info("for python %s the wheelhouse also needs %s", python_version, wanted)
    raise ImageError(f"the wheelhouse does not close for python {python_version}: {wanted}")


def _pip_download(into: Path, constraints: Path, wanted: list[str], quiet: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "--find-links",
        torch_links(),
        "-d",
        str(into),
        "-c",
        str(constraints),
        *wanted,
    ]
    log.info("downloading %d requirements into %s", len(wanted), into)
    result = subprocess.run(cmd, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        raise ImageError(f"pip download failed: {(result.stderr or '')[-2000:]}")


def _image_python(client: DockerClient, base: str) -> str:
    """The python3 version in `base` (the wheelhouse is resolved for it)."""
    out = client.containers.run(
        base,
        ["python3", "-c", "import platform; print(platform.python_version())"],
        remove=True,
        network_disabled=True,
    )
    return out.decode().strip()


def _tar_dir(directory: Path, dockerfile: bytes, out: Path) -> None:
    with tarfile.open(out, "w") as tar:
        tar.add(directory, arcname=".")
        add_bytes(tar, "Dockerfile", dockerfile)


def _tar_sources(dockerfile: bytes, out: Path) -> None:
    with tarfile.open(out, "w") as tar:
        for f in source_files():
            tar.add(f, arcname=str(f.relative_to(ROOT)), recursive=False)
        add_bytes(tar, "Dockerfile", dockerfile)


def build(
    quiet: bool = False,
    force: bool = False,
    env_file: Path | None = ENV_FILE,
    plugins: Sequence[Path] = (),
    learner_image: str | None = None,
) -> dict[Image, str]:
    """Build each image whose tag is missing (all with `force`), write `env_file`, return tags.

    With `plugins` (`--with`), the worker image's tag is that of the worker image with the
    plug-ins installed (`farm.plugins`), and so is `learner_image`'s, given, under LEARNER."""
    import docker
    from docker.errors import DockerException

    from farm.plugins import build_layer, check_sources
    from sandbox.errors import ImageBuildError
    from sandbox.image import ensure_base

    sources = check_sources(plugins)  # before anything is built
    if learner_image and not sources:
        raise ImageError("--learner-image adds plug-ins to a learner image: give --with PATH")
    try:
        client = docker.from_env(timeout=1800)
    except DockerException as exc:
        raise ImageError(f"no Docker engine: {exc}") from exc
    try:
        base = ensure_base(client, quiet)
        wanted = tags(base)
        with tempfile.TemporaryDirectory(prefix="rf-images-") as tmp:
            _build_missing(client, base, wanted, Path(tmp), quiet=quiet, force=force)
        if sources:
            wanted[WORKER] = build_layer(client, wanted[WORKER], sources, quiet=quiet, force=force)
        if learner_image:
            wanted[LEARNER] = build_layer(client, learner_image, sources, quiet=quiet, force=force)
    except (DockerException, ImageBuildError) as exc:
        raise ImageError(f"building the compose images failed: {exc}") from exc
    finally:
        client.close()
    if env_file is not None:
        write_env_file(env_file, wanted)
    return wanted


def _build_missing(
    client: DockerClient,
    base: str,
    wanted: dict[Image, str],
    tmp: Path,
    *,
    quiet: bool,
    force: bool,
) -> None:
    # The python image first: the worker image is built on it.
    if missing(client, wanted[PYTHON], force):
        wheels = tmp / "wheels"
        wheels.mkdir()
        wheelhouse(wheels, _image_python(client, base), quiet)
        _tar_dir(wheels, _dockerfile(PYTHON), tmp / "python.tar")
        build_image(client, wanted[PYTHON], tmp / "python.tar", {"BASE": base})
    if missing(client, wanted[WORKER], force):
        _tar_sources(_dockerfile(WORKER), tmp / "worker.tar")
        build_image(client, wanted[WORKER], tmp / "worker.tar", {"PYTHON_IMAGE": wanted[PYTHON]})
    for image in (REDIS, PROMETHEUS):
        if missing(client, wanted[image], force):
            context = tmp / f"{image.dockerfile}.tar"
            with tarfile.open(context, "w") as tar:
                add_bytes(tar, "Dockerfile", _dockerfile(image))
            build_image(client, wanted[image], context, {"BASE": base})


def _dockerfile(image: Image) -> bytes:
    return (DOCKERFILES / image.dockerfile).read_bytes()


def write_env_file(path: Path, wanted: dict[Image, str]) -> None:
    """The tags as ``VARIABLE=tag`` lines, which docker-compose substitutes into the file."""
    lines = ["# Written by `farm images build`: content tags of the compose stack's images."]
    lines += [f"{image.variable}={tag}" for image, tag in wanted.items() if image is not PYTHON]
    path.write_text("\n".join(lines) + "\n")


def main_images(args: argparse.Namespace) -> int:
    """`farm images build|tags`."""
    from sandbox.image import base_tag

    if args.images_command == "tags":
        for image, tag in tags(base_tag()).items():
            print(f"{image.variable}={tag}")
        return 0
    if args.quiet:
        logging.getLogger().setLevel(logging.WARNING)
    started = time.monotonic()
    wanted = build(
        quiet=args.quiet,
        force=args.force,
        env_file=args.env_file or ENV_FILE,
        plugins=args.with_paths or (),
        learner_image=args.learner_image,
    )
    if not args.quiet:
        print(
            f"images ready in {time.monotonic() - started:.0f} s; tags in {args.env_file or ENV_FILE}"
        )
        for tag in wanted.values():
            print(f"  {tag}")
    return 0
