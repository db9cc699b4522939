"""What Prometheus needs to watch a `farm up`: the targets file and, with `--monitor`, Prometheus.

`TargetsFile` keeps ``<work_dir>/targets.json``, a Prometheus file-service-discovery file
(``file_sd_configs``): one target group per child that serves ``/metrics`` while it runs,
labelled ``job="farm-<role>"`` (``farm-worker``, ``farm-learner``, ``farm-inference``: the
jobs the Kubernetes scrape config gives the same roles) and ``child="<name>"``, plus the
supervisor's own endpoint (job ``farm-supervisor``, no ``child``: its own series carry a
``process`` label naming the child they are about, which a target label of that name
would rename to ``exported_process``). The supervisor calls `TargetsFile.child`
as each child starts and exits, so a crashed child leaves the file until its restart
(``farm_supervisor_child_up`` says it is down meanwhile), and a stopped farm leaves an empty
list. Each write is a temporary file renamed over the old one: Prometheus never reads half a
file. Any Prometheus can use it (``file_sd_configs: [{files: [<work_dir>/targets.json]}]``).

`MonitorSettings` is the section of `farm up` that starts one: `--monitor` runs Debian's
``prometheus`` as the stack's first child (`prometheus_spec`), on 127.0.0.1, with its
configuration and data under ``<work_dir>/monitor/``, reading the targets file and the
shipped alert rules. Grafana is not started: no registry this project installs from carries
it (docs/monitoring.md); the dashboard JSON loads into any Grafana pointed at that URL.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from farm.errors import StartupError
from farm.supervisor import Probe, ProcessSpec

TARGETS = "targets.json"
ALERTS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "alerts.yml"
# the scrape job of each child, by the start of its name (farm.stack names them)
_JOBS = (
    ("worker-", "farm-worker"),
    ("learner", "farm-learner"),
    ("inference", "farm-inference"),
    ("vllm-", "farm-inference"),
)


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class MonitorSettings:
    """A local Prometheus on the farm's targets (docs/monitoring.md)."""

    monitor: bool = Field(
        False, description="start Prometheus on targets.json and the alert rules, print its URL"
    )
    prometheus_port: int = Field(
        9090, ge=0, le=65535, description="port of the --monitor Prometheus (0: free)"
    )
    prometheus_bin: str = Field("prometheus", min_length=1, description="the Prometheus binary")


def job_of(process: str) -> str:
    """The scrape job of a child, from its name."""
    for start, job in _JOBS:
        if process.startswith(start):
            return job
    return f"farm-{process}"


def _address(metrics_url: str) -> str:
    return urlsplit(metrics_url).netloc


class TargetsFile:
    """``targets.json``: the endpoints of the children that are running now."""

    def __init__(self, path: Path, metrics_urls: dict[str, str], supervisor_port: int) -> None:
        self.path = path
        self.endpoints = {name: _address(url) for name, url in metrics_urls.items()}
        self.supervisor = f"127.0.0.1:{supervisor_port}" if supervisor_port else None
        self.running: set[str] = set()
        self.open = False

    def start(self) -> None:
        """The supervisor's endpoint only: no child is running yet."""
        self.open = True
        self.write()

    def child(self, name: str, running: bool) -> None:
        """A child started (`running`) or exited."""
        if name not in self.endpoints:
            return
        (self.running.add if running else self.running.discard)(name)
        if self.open:
            self.write()

    def close(self) -> None:
        """The farm is stopping: nothing left to scrape."""
        self.open = False
        self.running.clear()
        self._replace([])

    def groups(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        if self.supervisor:
            out.append({"targets": [self.supervisor], "labels": {"job": "farm-supervisor"}})
        for name in sorted(self.running):
            labels = {"job": job_of(name), "child": name}
            out.append({"targets": [self.endpoints[name]], "labels": labels})
        return out

    def write(self) -> None:
        self._replace(self.groups())

    def _replace(self, groups: list[dict[str, object]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(groups, indent=1) + "\n")
        os.replace(tmp, self.path)


def prometheus_config(targets: Path) -> dict[str, object]:
    """Scrape every target of `targets` each 5 s; load the shipped alert rules if present."""
    return {
        "global": {"scrape_interval": "5s", "evaluation_interval": "15s"},
        "rule_files": [str(ALERTS)] if ALERTS.is_file() else [],
        "scrape_configs": [
            {
                "job_name": "farm",  # each group's own job label replaces it
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "30s"}],
            }
        ],
    }


def prometheus_spec(
    settings: MonitorSettings, work: Path, port: int, ready: Probe, *, dry_run: bool
) -> ProcessSpec:
    """Prometheus as a child of the farm; its config (JSON, which is YAML) is written here."""
    binary = shutil.which(settings.prometheus_bin)
    if binary is None:
        raise StartupError(
            f"--monitor needs {settings.prometheus_bin!r} (Debian package prometheus; "
            "scripts/bootstrap.sh installs it)"
        )
    directory = work / "monitor"
    config = directory / "prometheus.yml"
    if not dry_run:
        directory.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(prometheus_config(work / TARGETS), indent=1) + "\n")
    argv = (
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    )
    return ProcessSpec("prometheus", argv, ready=ready, ready_timeout_s=60, stop_timeout_s=30)
