"""`farm up` end to end: the real stack under the supervisor, a crash, Prometheus, Ctrl-C.

Starts `python -m farm up --monitor --archive DIR` as a subprocess (Debian's Prometheus,
private redis-server with AOF, the archiver, the CPU policy server on the tiny model, one
worker, the learner), kills the worker with SIGKILL and watches the supervisor restart it
(the worker runs a Docker sandbox pool, so the killed worker leaves containers behind for
the new pool to reap), reads the supervisor's /metrics and the status line, checks that
targets.json lists the restarted worker, reads throughput rates back through the farm's
Prometheus (which found every process through targets.json; the shipped alert rules are
loaded and must evaluate without error) and the farm's series on Prometheus's graph page
in headless Chromium, then sends SIGINT and checks that every process and sandbox
container the farm started, restarted ones included, is gone, that Redis kept its AOF,
and that `python -m learner --replay` trains from the segments the archiver wrote. One
test, because starting the stack is the expensive part.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from sandbox.docker_backend import LABEL, OWNER_LABEL
from tests.conftest import free_port, require
from tests.deploy.promql import ALERTS
from tests.deploy.promserver import PrometheusApi
from tests.farm.browser import console_rows

pytestmark = [pytest.mark.slow, pytest.mark.docker]

# the processes Prometheus scrapes, and their jobs (farm.monitor; the supervisor's target
# has no `child` label, so its own `process` label survives)
PROCESSES = {
    "inference": "farm-inference",
    "learner": "farm-learner",
    "worker-0": "farm-worker",
    "supervisor": "farm-supervisor",
}
PID = re.compile(r"^farm\s+\| (\S+) started \(pid (\d+)\)$")
PORT = re.compile(r"^farm\s+\| process (\S+): .* --(?:metrics-)?port (\d+)")


def _sandbox_owner_pids() -> list[int]:
    """Pids of the processes owning each sandbox container on this engine."""
    import docker

    client = docker.from_env()
    try:
        # The low-level listing: no per-container inspect racing other tests' removals.
        containers = client.api.containers(all=True, filters={"label": LABEL})
        owners = [(c.get("Labels") or {}).get(OWNER_LABEL, "::") for c in containers]
        return [int(owner.split(":")[1] or 0) for owner in owners]
    finally:
        client.close()


async def _until_sandboxes_of(pid: int, limit_s: float) -> None:
    for _ in range(int(limit_s / 0.5)):
        if pid in await asyncio.to_thread(_sandbox_owner_pids):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"worker {pid} started no sandbox container")


def _docker_ready() -> bool:
    try:
        import docker

        from sandbox.image import image_tag

        client = docker.from_env()
        try:
            client.images.get(image_tag())
            return True
        finally:
            client.close()
    except Exception:
        return False


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Farm:
    """The `farm up` subprocess and every line it printed."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.pids: dict[str, list[int]] = {}
        self.ports: dict[str, int] = {}
        self.cursor = 0

    async def until(self, pattern: str, limit_s: float) -> re.Match[str]:
        """The first line matching `pattern` after the previous match (reading more)."""
        regex = re.compile(pattern)
        while self.cursor < len(self.lines):
            self.cursor += 1
            if m := regex.search(self.lines[self.cursor - 1]):
                return m
        async with asyncio.timeout(limit_s):
            while True:
                raw = await self.proc.stdout.readline()  # type: ignore[union-attr]
                if not raw:
                    raise AssertionError(f"farm exited before {pattern!r}:\n" + self.tail())
                line = raw.decode().rstrip("\n")
                self.lines.append(line)
                if port := PORT.match(line):
                    self.ports[port[1]] = int(port[2])
                if started := PID.match(line):
                    self.pids.setdefault(started[1], []).append(int(started[2]))
                self.cursor = len(self.lines)
                if m := regex.search(line):
                    return m

    def tail(self) -> str:
        return "\n".join(self.lines[-40:])


async def test_farm_up_restarts_a_killed_worker_and_stops_cleanly_on_sigint(
    tmp_path: Path, tiny_model: Path
) -> None:
    require(_docker_ready(), "Docker engine with the sandbox image (python -m sandbox.image build)")
    require(shutil.which("chromium") is not None, "chromium (Debian package chromium)")
    metrics_port, prometheus_port = free_port(), free_port()
    archive = tmp_path / "archive"
    argv = [
        sys.executable,
        "-m",
        "farm",
        "up",
        "--workers",
        "1",
        "--work-dir",
        str(tmp_path),
        "--metrics-port",
        str(metrics_port),
        "--status-interval-s",
        "1",
        "--run",
        "uptest",
        "--sandbox-backend",
        "docker",
        "--model",
        str(tiny_model),
        "--monitor",
        "--prometheus-port",
        str(prometheus_port),
        "--archive",
        str(archive),
    ]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    farm = Farm(proc)
    try:
        await farm.until(r"^farm\s+\| all processes started$", 240)
        assert set(farm.pids) == {"prometheus", "redis", "archiver-0", *PROCESSES} - {"supervisor"}
        graph = (await farm.until(r"^farm\s+\| Prometheus at (http://\S+)/graph$", 10))[1]
        assert graph == f"http://127.0.0.1:{prometheus_port}"
        prometheus = PrometheusApi(graph)
        await prometheus.wait_ready()

        url = f"http://127.0.0.1:{metrics_port}/metrics"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(url) as response:
                text = await response.text()
        assert 'farm_supervisor_child_up{process="worker-0"} 1.0' in text

        await _until_sandboxes_of(farm.pids["worker-0"][0], 60)
        os.kill(farm.pids["worker-0"][0], signal.SIGKILL)
        await farm.until(r"worker-0 exited with status -9; restart in", 30)
        await farm.until(r"^farm\s+\| worker-0 started \(pid \d+\)$", 30)
        assert len(farm.pids["worker-0"]) == 2

        await farm.until(r"^worker-0\s+\| ", 60)  # the restarted worker's own output
        _check_targets(tmp_path / "targets.json", farm.ports, metrics_port)
        # The status line reads Redis (admission), the learner's and the server's metrics.
        await farm.until(r"^status\s+\| .*version \d+ \(served [\d,]+\).*\| admission \d+/\d+", 90)
        await _throughput_reads_back_through_prometheus(prometheus)
        await _series_on_the_graph_page(graph, tmp_path / "chromium")
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        await farm.until(r"^farm stopped \(received SIGINT\)$", 120)
        rc = await asyncio.wait_for(proc.wait(), 30)
    assert rc == 0, farm.tail()
    for name in ("redis", "inference", "learner"):
        assert any(re.match(rf"^{name}\s+\| ", line) for line in farm.lines), farm.tail()
    started = [pid for pids in farm.pids.values() for pid in pids]
    assert len(started) == 7
    assert [pid for pid in started if _alive(pid)] == []
    leftover = set(_sandbox_owner_pids()) & set(farm.pids["worker-0"])
    assert not leftover, f"sandbox containers of workers {leftover} left behind"
    assert list((tmp_path / "redis").glob("appendonly*")), "Redis kept no AOF"
    assert (tmp_path / "logs" / "worker-0.log").read_text()
    assert json.loads((tmp_path / "targets.json").read_text()) == []  # nothing left to scrape
    await _replay_trains_from(archive, tiny_model, tmp_path / "replayed")


def _check_targets(path: Path, ports: dict[str, int], supervisor_port: int) -> None:
    """targets.json lists every process that serves metrics, the restarted worker included."""
    groups = json.loads(path.read_text())
    found = {
        g["labels"].get("child", "supervisor"): (g["labels"]["job"], g["targets"]) for g in groups
    }
    ports = {**ports, "supervisor": supervisor_port}
    assert found == {p: (job, [f"127.0.0.1:{ports[p]}"]) for p, job in PROCESSES.items()}


def _child(series: str) -> str:
    found = re.search(r'child="([^"]+)"', series)
    return found[1] if found else "supervisor"


async def _series_on_the_graph_page(url: str, profile: Path) -> None:
    """Prometheus's graph page in headless Chromium shows the farm's series, populated."""
    rows = await console_rows(url, "up", profile)
    shown = {_child(series): value for series, value in rows}
    assert shown == dict.fromkeys(PROCESSES, "1"), rows
    rows = await console_rows(url, "sum by (child) (farm_worker_episodes_total)", profile)
    assert [series for series, _ in rows] == ['{child="worker-0"}'], rows
    assert float(rows[0][1]) > 0, rows


async def _replay_trains_from(archive: Path, model: Path, out: Path) -> None:
    """The archiver's segments hold the run's groups, and a new learner trains from them."""
    from broker.archive import Archive
    from broker.codec import decode
    from broker.messages import TrajectoryGroup
    from learner.checkpoint import latest_checkpoint, load_state

    entries = list(Archive(archive, readonly=True).entries())
    ids = [decode(fields, expect=TrajectoryGroup).group_id for _, fields in entries]  # type: ignore[union-attr]
    assert len(ids) >= 8 and len(set(ids)) == len(ids), len(ids)
    replay = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "learner", "--model", str(model), "--replay", str(archive)),
        *("--checkpoint-dir", str(out), "--groups-per-batch", "4", "--max-steps", "2"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(replay.communicate(), 300)
    assert replay.returncode == 0, output.decode()[-3000:]
    state = load_state(latest_checkpoint(out))  # type: ignore[arg-type]
    assert state.step == 2 and len(state.trained) == 2
    assert {g for step in state.trained for g in step} <= set(ids)


async def _throughput_reads_back_through_prometheus(prometheus: PrometheusApi) -> None:
    """Every farm process is scraped, and episode/token rates come back above zero."""
    async with asyncio.timeout(60):
        while True:
            up = await prometheus.query("up == 1")
            episodes = await prometheus.query("sum(rate(farm_worker_episodes_total[15s])) > 0")
            tokens = await prometheus.query(
                "sum(rate(farm_inference_tokens_generated_total[15s])) > 0"
            )
            if (
                {(r["metric"].get("child", "supervisor"), r["metric"]["job"]) for r in up}
                == set(PROCESSES.items())
                and episodes
                and tokens
            ):
                break
            await asyncio.sleep(1)
    assert float(episodes[0]["value"][1]) > 0
    assert float(tokens[0]["value"][1]) > 0
    restarts = await prometheus.query('farm_supervisor_restarts_total{process="worker-0"}')
    assert float(restarts[0]["value"][1]) >= 1
    # The shipped alert rules load and evaluate against the live farm without errors.
    for _ in range(60):  # each rule is evaluated every second once loaded
        rules = await prometheus.rules()
        if all(r["health"] != "unknown" for r in rules):
            break
        await asyncio.sleep(0.5)
    shipped = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert {r["name"] for r in rules} == shipped
    assert [r.get("lastError") for r in rules if r["health"] != "ok"] == []
