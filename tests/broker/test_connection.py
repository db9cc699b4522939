"""Connection options against real redis-servers: ACL users, TLS, retention, metrics."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import NoPermissionError

from broker.connection import RedisSettings, connect
from broker.errors import RedisAuthFailed, RedisUnavailable
from broker.keys import WORKERS_GROUP, RunKeys
from broker.producer import Producer
from tests.broker.helpers import make_task, task_consumer
from tests.conftest import free_port, require

KEYS = RunKeys("c")


async def test_acl_user_and_password(redis_server):
    admin = await connect(RedisSettings.from_url(redis_server.url))
    await admin.execute_command("ACL", "SETUSER", "farm", "on", ">s3cret", "~{c}:*", "+@all")
    await admin.aclose()
    url = f"redis://farm:s3cret@127.0.0.1:{redis_server.port}/0"
    client = await connect(RedisSettings.from_url(url))
    try:
        assert await Producer(client).publish(KEYS.tasks, [make_task("a")])
        with pytest.raises(NoPermissionError):
            await client.set("outside-the-run", 1)
    finally:
        await client.aclose()
    wrong = RedisSettings.from_url(
        f"redis://farm:nope@127.0.0.1:{redis_server.port}/0", retry_budget_s=0.3
    )
    with pytest.raises(RedisAuthFailed, match=r"farm:\*\*\*@"):
        await connect(wrong)


@pytest.fixture
def tls_server(tmp_path):
    require(shutil.which("openssl") is not None, "openssl")
    require(shutil.which("redis-server") is not None, "redis-server")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    yield port, cert
    proc.terminate()
    proc.wait(10)


async def test_rediss_url_with_ca_file(tls_server):
    port, cert = tls_server
    settings = RedisSettings.from_url(f"rediss://localhost:{port}/0", tls_ca_file=str(cert))
    client = await connect(settings)
    try:
        assert await client.ping()
        await _round_trip_large_entry(client)
    finally:
        await client.aclose()
    plain = RedisSettings.from_url(f"redis://localhost:{port}/0", retry_budget_s=0.3)
    with pytest.raises(RedisUnavailable):
        await connect(plain)


async def _round_trip_large_entry(client) -> None:
    """Replies far above the stream reader's default limit come back whole and in order."""
    bodies = [bytes([i]) * (3 << 20) for i in range(3)]
    for body in bodies:
        await client.xadd("{c}:big", {b"b": body})
    entries = await client.xrange("{c}:big")
    assert [fields[b"b"] for _, fields in entries] == bodies


async def test_large_entries_over_plain_tcp(redis_server):
    client = await connect(RedisSettings.from_url(redis_server.url))
    try:
        await _round_trip_large_entry(client)
    finally:
        await client.aclose()


async def test_counters_follow_the_traffic(redis_server):
    client = await connect(RedisSettings.from_url(redis_server.url))

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    try:
        before = value("farm_broker_published_total", stream=KEYS.tasks)
        acked = value("farm_broker_acked_total", stream=KEYS.tasks, group=WORKERS_GROUP)
        dead = value("farm_broker_deadlettered_total", stream=KEYS.tasks)
        await Producer(client).publish(KEYS.tasks, [make_task("m1"), make_task("m2")])
        await client.xadd(KEYS.tasks, {b"bad": b"1"})
        c = task_consumer(client, KEYS, "m", block_ms=10)
        await c.ensure_groups()
        await c.commit(await c.read())
        assert value("farm_broker_published_total", stream=KEYS.tasks) == before + 2
        assert value("farm_broker_acked_total", stream=KEYS.tasks, group=WORKERS_GROUP) == acked + 2
        assert value("farm_broker_deadlettered_total", stream=KEYS.tasks) == dead + 1
    finally:
        await client.aclose()
