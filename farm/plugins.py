"""The user's own packages in the farm's images: `farm images build --with PATH`.

A plug-in is a Python project directory (pyproject.toml or setup.py) or a wheel: an
environment, a reward function, an agent, whatever a task names by module. `build_layer`
puts the plug-ins into a copy of a farm image (the offline worker image, which also runs
the CPU learner and policy server; or a learner image given with ``--learner-image``) as
one more layer (deploy/docker/plugins.Dockerfile), without a registry:

1. on the host, each project becomes a wheel (`pip wheel --no-deps`, with the project's
   own build backend, from the package index the host reaches);
2. their requirements that the base image lacks are downloaded as wheels (`pip download
   --no-deps`, pinned to locks/cpu.txt's versions where it has them), round after
   round until nothing the wheelhouse needs is missing, markers evaluated for the image's
   Python; what the base already has is never downloaded again;
3. the layer installs the plug-ins from that wheelhouse with no index (pip refuses there
   if a plug-in needs another version of a package the image has), as root, then returns
   to the base image's user.

The image is tagged `<base repository>:<hash>` of the base image's id, the Dockerfile and
the plug-ins' files, so a rebuild with nothing changed is a look-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from farm.errors import ImageError

if TYPE_CHECKING:
    from docker import DockerClient

log = logging.getLogger(__name__)

DOCKERFILE = Path(__file__).resolve().parents[1] / "deploy" / "docker" / "plugins.Dockerfile"
# Not part of a project's content: build outputs and caches.
_SKIP = {"build", "dist", "__pycache__", ".git", ".venv", ".mypy_cache", ".pytest_cache"}
_ROUNDS = 10  # of dependency downloads: a chain deeper than this is a cycle or a runaway


def check_sources(paths: Sequence[Path]) -> list[Path]:
    """The plug-ins, resolved; ImageError naming the first that is not a project or a wheel."""
    out = []
    for path in paths:
        full = path.expanduser().resolve()
        project = full.is_dir() and any(
            (full / f).is_file() for f in ("pyproject.toml", "setup.py")
        )
        if not (project or (full.is_file() and full.suffix == ".whl")):
            raise ImageError(
                f"--with {path}: not a Python project (a directory with pyproject.toml or "
                "setup.py) or a wheel; make the code a package (docs/deploy.md, 'Your code')"
            )
        out.append(full)
    return out


def _files(source: Path) -> Iterator[Path]:
    if source.is_file():
        yield source
        return
    for f in sorted(source.rglob("*")):
        parts = set(f.relative_to(source).parts)
        if f.is_file() and not parts & _SKIP and not any(p.endswith(".egg-info") for p in parts):
            yield f


def layer_tag(base_repository: str, base_id: str, sources: Sequence[Path]) -> str:
    h = hashlib.sha256(base_id.encode() + b"\0" + DOCKERFILE.read_bytes())
    for source in sources:
        for f in _files(source):
            h.update(str(f.relative_to(source.parent)).encode() + b"\0" + f.read_bytes())
    return f"{base_repository}:{h.hexdigest()[:16]}"


def _pip(*args: str, quiet: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(cmd, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        raise ImageError(f"pip {args[0]} failed: {(result.stderr or '')[-2000:]}")


def wheelhouse(
    sources: Sequence[Path], into: Path, have: set[str], python: str, quiet: bool
) -> list[str]:
    """Fill `into` with the plug-ins' wheels and the dependencies `have` (the base image's
    distributions) lacks; the plug-ins' names."""
    from packaging.utils import parse_wheel_filename

    from farm.image_build import constraints_text, unmet

    for source in sources:
        if source.is_file():
            shutil.copy2(source, into / source.name)
        else:
            _pip("wheel", "--no-deps", "--wheel-dir", str(into), str(source), quiet=quiet)
    names = sorted(str(parse_wheel_filename(w.name)[0]) for w in into.glob("*.whl"))
    constraints = into.parent / "plugin-constraints.txt"
    constraints.write_text(constraints_text(python))
    for _ in range(_ROUNDS):
        wanted = unmet(into, python, have)
        if not wanted:
            return names
        log.info("plug-ins need %s, which the image lacks", wanted)
        download = ["download", "--only-binary", ":all:", "--no-deps", "-d", str(into)]
        _pip(*download, "-c", str(constraints), *wanted, quiet=quiet)
    raise ImageError(f"the plug-ins' dependencies do not close after {_ROUNDS} rounds: {wanted}")


def _image_facts(client: DockerClient, image: str) -> tuple[str, set[str]]:
    """The image's python version and the names of the distributions installed in it."""
    script = (
        "import importlib.metadata as m, json, platform; print(json.dumps("
        "[platform.python_version(), sorted({d.metadata['Name'] for d in m.distributions()})]))"
    )
    out = client.containers.run(
        image, ["-c", script], entrypoint=["python"], remove=True, network_disabled=True
    )
    version, names = json.loads(out.decode())
    return version, set(names)


def build_layer(
    client: DockerClient, base: str, sources: Sequence[Path], *, quiet: bool, force: bool
) -> str:
    """`base` with the plug-ins installed; its tag (built only when missing, or with `force`)."""
    from docker.errors import ImageNotFound

    from farm.image_build import add_bytes, build_image, missing

    try:
        image = client.images.get(base)
    except ImageNotFound as exc:
        raise ImageError(f"no image {base} here to add the plug-ins to") from exc
    tag = layer_tag(base.rsplit(":", 1)[0], image.id, sources)
    if not missing(client, tag, force):
        return tag
    python, have = _image_facts(client, base)
    work = Path(tempfile.mkdtemp(prefix="rf-plugins-"))
    try:
        wheels = work / "wheels"
        wheels.mkdir()
        names = wheelhouse(sources, wheels, have, python, quiet)
        (wheels / "plugins.txt").write_text("\n".join(names) + "\n")
        context = work / "plugins.tar"
        with tarfile.open(context, "w") as tar:
            tar.add(wheels, arcname=".")
            add_bytes(tar, "Dockerfile", DOCKERFILE.read_bytes())
        user = image.attrs.get("Config", {}).get("User") or "root"
        build_image(client, tag, context, {"BASE_IMAGE": base, "RUN_AS": user})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tag
