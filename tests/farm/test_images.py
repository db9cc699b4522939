"""`farm images`: the wheelhouse closes for the image's python and is the lock's, tags, and a
clear error.

The full offline build runs in tests/deploy/test_compose_stack.py; these are the parts
that answer in seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from farm import lock
from farm.errors import ImageError
from farm.image_build import constraints_text, locked_requirements, unmet
from farm.images import DOCKERFILES, PROMETHEUS, PYTHON, REDIS, WORKER, write_env_file


def _wheel(into: Path, name: str, version: str, requires: list[str]) -> None:
    """A wheel holding only its METADATA: all `unmet` reads."""
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(into / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(meta) + "\n")


def test_a_dependency_behind_a_python_version_marker_is_found_for_the_image(
    tmp_path: Path,
) -> None:
    """redis needs async-timeout below python 3.11.3 (bookworm's python3 is 3.11.2): pip on
    a newer host skips it, and the wheelhouse must still get it."""
    _wheel(
        tmp_path,
        "redis",
        "8.1.0",
        [
            'async-timeout>=4.0.3; python_full_version < "3.11.3"',
            'hiredis>=3.2; extra == "hiredis"',
        ],
    )
    _wheel(tmp_path, "numpy", "2.3.0", [])
    assert unmet(tmp_path, "3.11.2") == ["async-timeout>=4.0.3"]
    assert unmet(tmp_path, "3.11.7") == []
    _wheel(tmp_path, "async_timeout", "5.0.1", [])  # a wheel's name is normalized
    assert unmet(tmp_path, "3.11.2") == []


def test_env_file_names_the_images_compose_uses(tmp_path: Path) -> None:
    tags = {i: f"{i.repository}:abc" for i in (PYTHON, WORKER, REDIS, PROMETHEUS)}
    env = tmp_path / ".env"
    write_env_file(env, tags)
    lines = [line for line in env.read_text().splitlines() if not line.startswith("#")]
    assert lines == [
        "FARM_WORKER_IMAGE=rollout-farm/worker:abc",
        "FARM_REDIS_IMAGE=rollout-farm/redis:abc",
        "FARM_PROMETHEUS_IMAGE=rollout-farm/prometheus:abc",
    ]
    compose = (Path(__file__).parents[2] / "deploy/compose/docker-compose.yml").read_text()
    for image in (WORKER, REDIS, PROMETHEUS):
        assert "${" + image.variable + ":-" in compose


def test_tags_answer_without_docker_and_build_without_an_engine_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-such.sock"}
    tags = subprocess.run(
        [sys.executable, "-m", "farm", "images", "tags"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tags.returncode == 0, tags.stderr
    assert [line.split("=")[0] for line in tags.stdout.split()] == [
        "FARM_PYTHON_IMAGE",
        "FARM_WORKER_IMAGE",
        "FARM_REDIS_IMAGE",
        "FARM_PROMETHEUS_IMAGE",
    ]
    build = subprocess.run(
        [sys.executable, "-m", "farm", "images", "build", "--env-file", str(tmp_path / ".env")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert build.returncode == 1
    assert "farm: no Docker engine" in build.stderr
    assert not (tmp_path / ".env").exists()


def test_with_refuses_what_is_not_a_package_before_building(tmp_path: Path) -> None:
    """`--with` takes a project directory or a wheel; anything else is refused by name
    before an image is built (or an engine is looked for)."""
    loose = tmp_path / "my_env.py"
    loose.write_text("x = 1\n")
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-such.sock"}
    build = subprocess.run(
        [sys.executable, "-m", "farm", "images", "build", "--with", str(loose)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert build.returncode == 1
    assert f"--with {loose}: not a Python project" in build.stderr
    assert "no Docker engine" not in build.stderr


def test_plugin_layer_tag_follows_the_plugins_content_only(tmp_path: Path) -> None:
    from farm.plugins import check_sources, layer_tag

    project = tmp_path / "plug"
    (project / "plug").mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'plug'\nversion = '1'\n")
    (project / "plug" / "__init__.py").write_text("A = 1\n")
    sources = check_sources([project])
    first = layer_tag("rollout-farm/worker", "sha256:base", sources)
    assert first.startswith("rollout-farm/worker:")
    (project / "build" / "lib").mkdir(parents=True)  # what a wheel build leaves behind
    (project / "build" / "lib" / "x.py").write_text("junk\n")
    (project / "plug.egg-info").mkdir()
    (project / "plug.egg-info" / "PKG-INFO").write_text("junk\n")
    assert layer_tag("rollout-farm/worker", "sha256:base", sources) == first
    assert layer_tag("rollout-farm/worker", "sha256:other", sources) != first
    (project / "plug" / "__init__.py").write_text("A = 2\n")
    assert layer_tag("rollout-farm/worker", "sha256:base", sources) != first


def test_what_the_image_has_is_not_fetched_again(tmp_path: Path) -> None:
    _wheel(tmp_path, "plug", "1", ["numpy>=2", "inflection>=0.5"])
    assert unmet(tmp_path, "3.11.2") == ["inflection>=0.5", "numpy>=2"]
    assert unmet(tmp_path, "3.11.2", have={"NumPy"}) == ["inflection>=0.5"]


def test_the_plugin_layer_pulls_nothing_and_returns_to_the_base_user() -> None:
    from farm.plugins import DOCKERFILE

    lines = DOCKERFILE.read_text().splitlines()
    assert [line.split()[1] for line in lines if line.startswith("FROM ")] == ["${BASE_IMAGE}"]
    assert "--no-index" in DOCKERFILE.read_text()
    assert [line for line in lines if line.startswith("USER ")] == ["USER root", "USER ${RUN_AS}"]


def test_the_wheelhouse_installs_as_the_locks_lines_and_refuses_a_wheel_off_the_lock(
    tmp_path: Path,
) -> None:
    """The python image installs requirements.txt with --require-hashes --no-deps: each wheel
    must be the lock's version for the image's python, and comes with the lock's hashes."""
    pins = lock.for_python(lock.read("cpu"), "3.11.2")
    _wheel(tmp_path, "numpy", pins["numpy"].version, [])
    _wheel(tmp_path, "async_timeout", pins["async-timeout"].version, [])  # 3.11.2 only
    lines = locked_requirements(tmp_path, "3.11.2").splitlines()
    assert lines == [pins["async-timeout"].requirement(), pins["numpy"].requirement()]
    assert all(" --hash=sha256:" in line and ";" not in line for line in lines)
    with pytest.raises(ImageError, match=r"async_timeout-.*has async-timeout not at all"):
        locked_requirements(tmp_path, "3.11.7")
    _wheel(tmp_path, "numpy", "2.0.0", [])
    with pytest.raises(ImageError, match=rf"numpy-2\.0\.0.* at {pins['numpy'].version} for"):
        locked_requirements(tmp_path, "3.11.2")


def test_the_wheelhouse_is_downloaded_under_the_locks_pins_for_the_images_python() -> None:
    """redis needs async-timeout below python 3.11.3 only: pinned for bookworm's 3.11.2."""
    bookworm = constraints_text("3.11.2").splitlines()
    pins = lock.for_python(lock.read("cpu"), "3.11.2")
    assert f"async-timeout=={pins['async-timeout'].version}" in bookworm
    assert not any(c.startswith("async-timeout==") for c in constraints_text("3.11.7").split())
    assert f"torch=={pins['torch'].version}" in bookworm and pins["torch"].version.endswith("+cpu")


def test_every_image_installs_its_python_packages_from_a_lock_with_hashes() -> None:
    python = (DOCKERFILES / PYTHON.dockerfile).read_text()
    assert "--require-hashes --no-deps -r /tmp/wheels/requirements.txt" in python
    learner = (DOCKERFILES / "learner.Dockerfile").read_text()
    assert "python3 -m farm.lock requirements --lock gpu --keep-stack" in learner
    assert "pip install --require-hashes --no-deps -r" in learner
    assert "COPY locks ./locks" in learner


def test_every_agent_spec_the_docs_name_is_installed_by_the_project_and_its_images() -> None:
    """A documented `examples.<module>:<fn>` spec must import in the images: the package is
    installed (pyproject's packages), the worker image copies it, and its dependencies (the
    `openai` SDK: the `agent` extra) are in the image's extras."""
    import re
    import tomllib

    from setuptools import find_namespace_packages

    from farm.images import EXTRAS, SOURCES

    root = Path(__file__).resolve().parents[2]
    docs = "".join(p.read_text() for p in [root / "README.md", *(root / "docs").glob("*.md")])
    specs = set(re.findall(r"\b(examples(?:\.\w+)+):\w+", docs))
    assert "examples.code_tool_agent" in specs
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    installed = set(find_namespace_packages(str(root), include=find["include"]))
    for spec in sorted(specs):
        package, _, module = spec.rpartition(".")
        assert package in installed, f"{spec}: package {package} is not installed"
        assert (root / package.replace(".", "/") / f"{module}.py").is_file(), spec
        assert package.split(".")[0] in SOURCES, f"{spec}: the worker image does not copy it"
    assert "agent" in EXTRAS and any(
        r.startswith("openai") for r in pyproject["project"]["optional-dependencies"]["agent"]
    )
