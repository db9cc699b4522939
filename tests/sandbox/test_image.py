"""The offline image recipe: mirror discovery from apt sources, content tags, and the
idempotent build against the real engine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandbox import SandboxConfig
from sandbox.image import DEFAULT_MIRROR, apt_mirror, image_tag
from tests.sandbox.conftest import require_backend


def test_mirror_from_deb822_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: trixie-security\n"
        "Components: main\n\n"
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\nSuites: trixie trixie-updates\n"
        "Components: main\n"
    )
    (tmp_path / "sources.list.d" / "other.list.disabled").write_text(
        "deb http://x/debian sid main\n"
    )
    assert apt_mirror(tmp_path) == ("http://mirror.example/debian", "trixie")


def test_mirror_from_one_line_sources_and_default(tmp_path: Path) -> None:
    assert apt_mirror(tmp_path) == DEFAULT_MIRROR
    (tmp_path / "sources.list").write_text(
        "# deb http://old/debian buster main\n"
        "deb [signed-by=/k.gpg] http://ftp.example/debian/ bookworm main contrib\n"
    )
    assert apt_mirror(tmp_path) == ("http://ftp.example/debian", "bookworm")


def test_image_tag_is_a_content_hash() -> None:
    tag = image_tag()
    assert tag.startswith("rollout-farm/sandbox:") and len(tag.split(":")[1]) == 16
    assert image_tag() == tag


def test_config_rejects_unknown_keys_and_bad_bounds() -> None:
    with pytest.raises(ValidationError):
        SandboxConfig(backend="docker", warm_size=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        SandboxConfig(backend="none")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        SandboxConfig(warm=5, max_sandboxes=2)
    with pytest.raises(ValidationError):
        SandboxConfig(socket_dir=Path("/tmp/" + "x" * 60))


def test_session_memory_shares_fit_in_the_sandbox() -> None:
    # unset: 640 MiB a session, the sandbox holds them all and the agent's 64 MiB
    assert SandboxConfig(sessions_per_sandbox=4).memory_plan() == (4 * 640 + 64, 640)
    # memory_mb set: an equal share of it; bwrap jails hold one session each
    assert SandboxConfig(memory_mb=576, sessions_per_sandbox=2).memory_plan() == (576, 256)
    assert SandboxConfig(backend="bwrap", memory_mb=576, work_mb=64).memory_plan() == (576, 512)
    with pytest.raises(ValidationError, match="cannot hold"):
        SandboxConfig(memory_mb=1024, sessions_per_sandbox=4, session_memory_mb=512)
    with pytest.raises(ValidationError, match="files are memory"):
        SandboxConfig(memory_mb=1024, sessions_per_sandbox=16)  # 60 MiB each < work_mb


@pytest.mark.docker
def test_build_is_idempotent_and_fast_when_tagged() -> None:
    require_backend("docker")  # builds the image once for the session
    from sandbox.image import build

    began = time.monotonic()
    assert build(quiet=True) == image_tag()
    assert time.monotonic() - began < 5


@pytest.mark.docker
def test_cli_build_quiet_is_what_the_test_script_runs() -> None:
    import subprocess
    import sys

    require_backend("docker")
    tag = subprocess.run(
        [sys.executable, "-m", "sandbox.image", "tag"], capture_output=True, check=True, text=True
    ).stdout.strip()
    assert tag == image_tag()
    built = subprocess.run(
        [sys.executable, "-m", "sandbox.image", "build", "--quiet"],
        capture_output=True,
        check=False,
        text=True,
    )
    assert built.returncode == 0 and built.stdout == "", built.stderr


@pytest.mark.docker
async def test_a_missing_explicit_image_is_a_clear_error() -> None:
    from sandbox import SandboxPool, SandboxUnavailable
    from tests.sandbox.conftest import SOCKET_DIR

    require_backend("docker")
    config = SandboxConfig(image="rollout-farm/sandbox:does-not-exist", socket_dir=SOCKET_DIR)
    pool = SandboxPool(config)
    with pytest.raises(SandboxUnavailable, match="does-not-exist"):
        await pool.start()
    await pool.close()
