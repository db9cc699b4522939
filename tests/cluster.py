"""A real local Redis Cluster for tests: 3 masters and 3 replicas on loopback ports.

`LocalCluster.start()` launches six Debian `redis-server` processes with
``--cluster-enabled yes`` in a temporary directory, joins them with
``redis-cli --cluster create --cluster-replicas 1``, and waits until every node
reports ``cluster_state:ok`` and every replica's link to its master is up. A small
``cluster-node-timeout`` makes a killed master's replica take over in seconds.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

NODE_TIMEOUT_MS = 1000


def _free_port_pair() -> int:
    """A free port whose cluster bus port (port + 10000) is free as well."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@dataclass
class LocalCluster:
    """Six redis-server processes forming one cluster; `stop()` ends them all."""

    directory: Path
    tls: tuple[Path, Path] | None = None  # (certificate, key): TLS on clients, bus and replication
    ports: list[int] = field(default_factory=list)
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """The farm's cluster URL, naming one node (the client discovers the rest)."""
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://127.0.0.1:{self.ports[0]}/0"

    def start(self, nodes: int = 6) -> None:
        self.ports = [_free_port_pair() for _ in range(nodes)]
        for port in self.ports:
            self._launch(port)
        tls = ["--tls", "--cacert", str(self.tls[0])] if self.tls else []
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        create = ["redis-cli", *tls, "--cluster", "create", *nodes, "--cluster-replicas", "1"]
        subprocess.run([*create, "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok(len(self.ports))

    def _launch(self, port: int) -> None:
        node_dir = self.directory / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            cert, key = (str(p) for p in self.tls)
            listen = [
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--tls-cluster",
                "yes",
                "--tls-replication",
                "yes",
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
                "--tls-ca-cert-file",
                cert,
                "--tls-auth-clients",
                "no",
            ]
        else:
            listen = ["--port", str(port)]
        args = [
            "redis-server",
            *listen,
            "--bind",
            "127.0.0.1",
            "--dir",
            str(node_dir),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--cluster-replica-validity-factor",
            "0",  # a replica may always take over
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ]
        self.processes[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.node(port).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"cluster node on port {port} did not start")

    def node(self, port: int) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls[0])} if self.tls else {}
        return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=1, **tls)

    def live_ports(self) -> list[int]:
        return [p for p, proc in self.processes.items() if proc.poll() is None]

    def wait_ok(self, replicas_up: int, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and `replicas_up`/2 replicas are linked."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = [self.node(p).cluster("info")["cluster_state"] for p in self.live_ports()]
                linked = sum(
                    1
                    for p in self.live_ports()
                    if self.node(p).info("replication").get("master_link_status") == "up"
                )
                if all(s == "ok" for s in states) and linked >= replicas_up // 2:
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout_s}s")
            time.sleep(0.1)

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s slot now."""
        port = self.live_ports()[0]
        slot = int(self.node(port).cluster("keyslot", key))
        for (start, end), info in _slot_ranges(self.node(port)).items():
            if start <= slot <= end:
                return info
        raise RuntimeError(f"slot {slot} has no master")

    def replica_of(self, master: int) -> int:
        """The port of a live replica of the master on port `master`."""
        for row in self.node(master).execute_command("CLUSTER SLOTS"):
            if int(row[2][1]) == master and len(row) > 3:
                return int(row[3][1])
        raise RuntimeError(f"no replica of {master}")

    def flush(self) -> None:
        """Empty every master (replicas follow), keeping the topology."""
        for port in self.live_ports():
            if self.node(port).info("replication")["role"] == "master":
                self.node(port).flushall()

    def kill(self, port: int) -> None:
        """SIGKILL one node: no shutdown, no save."""
        proc = self.processes[port]
        proc.kill()
        proc.wait(10)

    def restart(self, port: int) -> None:
        """Start a killed node again: it keeps its identity (nodes.conf) and rejoins, as a
        replica of whichever node took over its slots, after a full sync (no AOF)."""
        self._launch(port)

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _slot_ranges(client: redis.Redis) -> dict[tuple[int, int], int]:
    """(first slot, last slot) -> master port, from CLUSTER SLOTS."""
    ranges = {}
    for row in client.execute_command("CLUSTER SLOTS"):
        start, end, master = row[0], row[1], row[2]
        ranges[(int(start), int(end))] = int(master[1])
    return ranges
