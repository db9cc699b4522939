"""docker-compose for the deploy tests: the CLI to use, and one project brought up for real.

`Stack` runs ``docker-compose`` with a project name of its own (so its containers,
network and volumes never meet another test's or another user's) and always tears
down with ``down -v``. Containers are addressed through compose, never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import require
from tests.deploy.promql import DEPLOY

COMPOSE = DEPLOY / "compose" / "docker-compose.yml"


def compose_cli() -> list[str]:
    """docker-compose (Debian's, what scripts/bootstrap.sh installs) or the v2 plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    require(False, "docker-compose (Debian package docker-compose) or the docker compose plugin")
    raise AssertionError("unreachable")


def gpu_profile(*overrides: str) -> dict[str, Any]:
    """The gpu profile's services as compose resolves them (with `overrides`, file names
    beside the compose file), with no FARM_* variable of this process substituted."""
    files = [arg for f in overrides for arg in ("-f", str(COMPOSE.parent / f))]
    cli = [*compose_cli(), "-f", str(COMPOSE), *files, "--profile", "gpu", "config"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    result = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def states(ids: list[str]) -> list[dict[str, object]]:
    """`docker inspect` State of each container in `ids`. Cheap enough to poll, where a
    docker-compose call costs about half a CPU second, taken from the stack under test."""
    if not ids:
        return []
    out = subprocess.run(
        ["docker", "inspect", *ids], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [c["State"] for c in json.loads(out)]


class Stack:
    """One compose project: `files` merged in order, `env` for variable substitution."""

    def __init__(self, project: str, files: list[Path], env: dict[str, str]) -> None:
        self.base = [*compose_cli(), "-p", project]
        for f in files:
            self.base += ["-f", str(f)]
        self.env = env

    def run(self, *args: str, timeout: float = 300) -> str:
        """Run a compose command; its stdout, or AssertionError with its output."""
        result = subprocess.run(
            [*self.base, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            cwd=COMPOSE.parent,
        )
        assert result.returncode == 0, (
            f"{' '.join(args)}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
        )
        return result.stdout

    def port(self, service: str, port: int) -> int:
        """The host port published for `service`'s container `port`."""
        return int(self.run("port", service, str(port)).strip().rsplit(":", 1)[1])

    def ids(self, service: str) -> list[str]:
        """The ids of `service`'s containers (a restart keeps a container's id)."""
        return self.run("ps", "-q", service).split()

    def state(self, service: str) -> list[dict[str, object]]:
        """`docker inspect` State of each container of `service`."""
        return states(self.ids(service))

    def logs(self, *services: str, tail: int = 60) -> str:
        result = subprocess.run(
            [*self.base, "logs", "--no-color", "--tail", str(tail), *services],
            capture_output=True,
            text=True,
            timeout=120,
            env=self.env,
            cwd=COMPOSE.parent,
        )
        return result.stdout + result.stderr

    def stacks(self, service: str) -> str:
        """Where a service that does not exit is waiting: its state, and the thread and
        asyncio-task stacks it writes on SIGUSR1 (launch.runner), read back from its log."""
        ids = self.run("ps", "-q", service).split()
        subprocess.run(["docker", "kill", "-s", "USR1", *ids], capture_output=True, timeout=60)
        time.sleep(2)
        return f"{service} state {self.state(service)}\n{self.logs(service, tail=200)}"

    def down(self) -> None:
        subprocess.run(
            [*self.base, "down", "-v", "--remove-orphans", "-t", "10"],
            capture_output=True,
            timeout=300,
            env=self.env,
            cwd=COMPOSE.parent,
        )
