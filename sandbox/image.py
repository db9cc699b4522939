"""Offline build of the sandbox image: debootstrap rootfs, `docker import`, add the agent.

No registry is reachable, so the image starts from a Debian rootfs made with
`debootstrap --variant=minbase --include=python3` from the mirror that this machine's
own apt sources name. The rootfs tarball is cached (``/var/cache/rollout-farm`` or
``$FARM_SANDBOX_CACHE``) under a hash of its recipe and imported as the base image;
the agent is baked in by a one-layer build on top. The final tag is a hash of the
agent source and the recipe, so `build` is a no-op when the tag exists and an agent
change rebuilds only the thin layer.

    python -m sandbox.image build [--quiet] [--force]
    python -m sandbox.image tag
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox.backends import agent_files
from sandbox.errors import ImageBuildError

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)

REPOSITORY = "rollout-farm/sandbox"
BASE_REPOSITORY = "rollout-farm/sandbox-base"
INCLUDE = "python3"
DEFAULT_MIRROR = ("http://deb.debian.org/debian", "bookworm")
DOCKERFILE = """FROM {base}
COPY agent /opt/agent/agent
USER 65534:65534
WORKDIR /work
CMD ["python3", "-I", "-S", "/opt/agent/agent", "--socket-dir", "/run/agent", "--work-dir", "/work"]
"""


def apt_mirror(root: Path = Path("/etc/apt")) -> tuple[str, str]:
    """(URI, suite) of the first main Debian archive in the apt sources, deb822 or one-line."""
    entries: list[tuple[str, str]] = []
    files = [root / "sources.list", *sorted((root / "sources.list.d").glob("*.list"))]
    for path in files:
        for line in _read(path).splitlines():
            parts = line.split("#", 1)[0].split()
            if len(parts) >= 3 and parts[0] == "deb":
                rest = [p for p in parts[1:] if not p.startswith("[")]
                entries.append((rest[0], rest[1]))
    for path in sorted((root / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", _read(path)):
            fields = _deb822(stanza)
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                for uri in fields.get("uris", "").split():
                    entries.extend((uri, suite) for suite in fields.get("suites", "").split())
    for uri, suite in entries:
        if uri.rstrip("/").endswith("/debian") and "-" not in suite:
            return uri.rstrip("/"), suite
    return DEFAULT_MIRROR


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _deb822(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in stanza.splitlines():
        if line.startswith("#") or ":" not in line or line[:1].isspace():
            continue
        key, _, value = line.partition(":")
        fields[key.strip().lower()] = value.strip()
    return fields


def recipe() -> str:
    mirror, suite = apt_mirror()
    return f"debootstrap --variant=minbase --include={INCLUDE} {suite} {mirror}"


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def base_tag() -> str:
    return f"{BASE_REPOSITORY}:{_digest(recipe().encode())}"


def image_tag() -> str:
    """The content tag of the sandbox image: agent source + recipe + Dockerfile."""
    agent = [f.name.encode() + b"\0" + f.read_bytes() for f in agent_files()]
    parts = (*agent, recipe().encode(), DOCKERFILE.encode())
    return f"{REPOSITORY}:{_digest(*parts)}"


def cache_dir() -> Path:
    configured = os.environ.get("FARM_SANDBOX_CACHE")
    if configured:
        return Path(configured)
    system = Path("/var/cache/rollout-farm")
    if os.access(system.parent, os.W_OK) or os.access(system, os.W_OK):
        return system
    return Path.home() / ".cache" / "rollout-farm"


def rootfs_tarball(quiet: bool) -> Path:
    """The cached debootstrap rootfs tarball; made once per recipe."""
    mirror, suite = apt_mirror()
    out = cache_dir() / f"rootfs-{_digest(recipe().encode())}.tar"
    if out.exists():
        return out
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed (apt-get install debootstrap)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rf-rootfs-") as tmp:
        target = Path(tmp) / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={INCLUDE}",
            suite,
            str(target),
            mirror,
        ]
        log.info("running %s", " ".join(cmd))
        _run(cmd, quiet)
        for junk in (
            "var/cache/apt/archives",
            "usr/share/doc",
            "usr/share/man",
            "var/lib/apt/lists",
        ):
            shutil.rmtree(target / junk, ignore_errors=True)
        partial = out.with_suffix(".partial")
        _run(["tar", "-C", str(target), "--numeric-owner", "-cf", str(partial), "."], quiet)
        partial.rename(out)  # atomic: a crashed build never leaves a half tarball
    return out


def _run(cmd: list[str], quiet: bool) -> None:
    result = subprocess.run(cmd, capture_output=quiet, check=False)
    if result.returncode != 0:
        tail = (result.stderr or b"")[-2000:].decode(errors="replace")
        raise ImageBuildError(f"{cmd[0]} failed with exit code {result.returncode}: {tail}")


def build(quiet: bool = False, force: bool = False) -> str:
    """Build the image unless its content tag exists; returns the tag."""
    import docker
    from docker.errors import BuildError, DockerException, ImageNotFound

    tag = image_tag()
    client = docker.from_env(timeout=600)
    try:
        if not force:
            try:
                client.images.get(tag)
                return tag
            except ImageNotFound:
                pass
        base = ensure_base(client, quiet)
        context = _context(base)
        client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, forcerm=True)
        return tag
    except (BuildError, DockerException) as exc:
        raise ImageBuildError(f"building {tag} failed: {exc}") from exc
    finally:
        client.close()


def ensure_base(client: DockerClient, quiet: bool) -> str:
    """Import the debootstrap rootfs as the base image unless its tag exists; returns the tag.

    The compose stack's images (`farm.images`) start from the same base.
    """
    from docker.errors import ImageNotFound

    base = base_tag()
    try:
        client.images.get(base)
    except ImageNotFound:
        tarball = rootfs_tarball(quiet)
        log.info("importing %s as %s", tarball, base)
        _run(["docker", "import", str(tarball), base], quiet)
    return base


def _context(base: str) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        files = [(f"agent/{f.name}", f.read_bytes()) for f in agent_files()]
        for name, data in (("Dockerfile", DOCKERFILE.format(base=base).encode()), *files):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox.image", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the sandbox image (no-op when its tag exists)")
    b.add_argument("--quiet", action="store_true", help="only errors")
    b.add_argument("--force", action="store_true", help="rebuild the agent layer even if tagged")
    sub.add_parser("tag", help="print the content tag the build produces")
    args = parser.parse_args(argv)
    if args.command == "tag":
        print(image_tag())
        return 0
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        tag = build(quiet=args.quiet, force=args.force)
    except ImageBuildError as exc:
        print(f"sandbox image build failed: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
