"""The broker on a real Redis Cluster (3 masters, 3 replicas) and on one node: the slot
layout of a run's partitions, per-slot reads and commits, ACL users, WAIT for replicas,
and the `python -m broker` commands over every partition."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MovedError,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)

from broker.admission import AdmissionBudget
from broker.connection import RedisSettings, connect, redis_errors
from broker.consumer import Consumer, ConsumerConfig, ConsumerSettings
from broker.deadletters import list_dead_letters, requeue
from broker.errors import RedisAuthFailed, RedisCommandFailed, RedisUnavailable
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import Task, TrajectoryGroup
from broker.producer import Producer
from tests.broker.helpers import make_group, make_task
from tests.cluster import LocalCluster
from tests.conftest import require

KEYS = RunKeys("cl", partitions=3)


@pytest.fixture
async def redis(broker_url):
    client = await connect(RedisSettings.from_url(broker_url))
    yield client
    await client.aclose()


def commit_keys(keys: RunKeys, p: int) -> list[str]:
    """Every key the worker's and the learner's commit touch in partition `p`."""
    return [
        keys.task_stream(p),
        keys.trajectories(p),
        keys.deadletter_of(p),
        keys.seen(WORKERS_GROUP, p),
        keys.seen(LEARNER_GROUP, p),
    ]


def test_partitions_and_runs_spread_over_the_cluster(redis_cluster: LocalCluster) -> None:
    node = redis_cluster.node(redis_cluster.ports[0])
    masters: dict[str, set[int]] = {}
    for run in ("alpha", "beta", "gamma", "delta", "epsilon"):
        keys = RunKeys(run, partitions=4)
        for p in range(keys.partitions):
            slots = {int(node.cluster("keyslot", k)) for k in commit_keys(keys, p)}
            assert len(slots) == 1, f"partition {p} of {run} spans slots {slots}"
            assert keys.partition_of(keys.task_stream(p)) == p
        # the run-wide budget shares partition 0's slot and is one key
        assert node.cluster("keyslot", keys.admission) == node.cluster("keyslot", keys.tasks)
        masters[run] = {redis_cluster.master_of(keys.trajectories(p)) for p in range(4)}
    assert all(len(m) >= 2 for m in masters.values()), masters  # one run uses several nodes
    firsts = {redis_cluster.master_of(RunKeys(run).tasks) for run in masters}
    assert len(firsts) >= 2  # several runs land on different nodes
    # partition 0 keeps the names a single-partition run always had
    assert (KEYS.tasks, KEYS.trajectories(0), KEYS.deadletter) == (
        "{cl}:tasks",
        "{cl}:trajectories",
        "{cl}:deadletter",
    )
    assert KEYS.trajectories(2) == "{cl:2}:trajectories"
    with pytest.raises(ValueError):
        KEYS.partition_of("{other:1}:tasks")


async def test_worker_and_learner_consumers_over_partitions(redis) -> None:
    tasks = [make_task(f"t{i}") for i in range(12)]
    part = {t.task_id: i % 3 if i < 9 else 0 for i, t in enumerate(tasks)}  # uneven on purpose
    by_part = Counter(part.values())
    producer = Producer(redis)
    for t in tasks:
        await producer.publish(KEYS.task_stream(part[t.task_id]), [t])
    await redis.xadd(KEYS.task_stream(2), {b"k": b"task", b"v": b"1", b"b": b"\xc1"})
    cfg = ConsumerConfig(group=WORKERS_GROUP, consumer="w", block_ms=50)
    worker = Consumer(redis, KEYS, KEYS.all_tasks, cfg, expect=Task)
    await worker.ensure_groups()
    got = []
    while batch := await worker.read(count=2):
        assert len(batch) <= 2  # COUNT holds over all the partitions read
        got += batch
        for d in batch:  # the worker's commit: its task's own partition, one script
            p = KEYS.partition_of(d.stream)
            await worker.commit(
                [d], publish=[(KEYS.trajectories(p), make_group(d.message.task_id))]
            )
    assert sorted(d.message.task_id for d in got) == sorted(t.task_id for t in tasks)
    for p in range(3):
        assert await redis.xlen(KEYS.trajectories(p)) == by_part[p]
        assert await redis.zcard(KEYS.seen(WORKERS_GROUP, p)) == by_part[p]
        assert (await redis.xpending(KEYS.task_stream(p), WORKERS_GROUP))["pending"] == 0
    # the undecodable task went to its own partition's dead letters
    assert await redis.xlen(KEYS.deadletter_of(2)) == 1
    assert [letter.source_stream for _, letter in await list_dead_letters(redis, KEYS)] == [
        KEYS.task_stream(2)
    ]
    # a redelivered task that was committed is dropped through its partition's seen set
    await producer.publish(KEYS.task_stream(part["t0"]), [make_task("t0")])
    assert await worker.read(count=5) == []
    learner = Consumer(
        redis,
        KEYS,
        KEYS.all_trajectories,
        ConsumerConfig(group=LEARNER_GROUP, consumer="l", block_ms=50),
        expect=TrajectoryGroup,
    )
    await learner.ensure_groups()
    groups = []
    while batch := await learner.read(count=100):
        groups += batch
    assert len(groups) == 12
    await learner.commit(groups)  # one call spanning three slots: one script per slot
    for p in range(3):
        assert (await redis.xpending(KEYS.trajectories(p), LEARNER_GROUP))["pending"] == 0
        assert await redis.zcard(KEYS.seen(LEARNER_GROUP, p)) == by_part[p]


async def test_dead_letter_commit_and_requeue_stay_in_the_partition(redis) -> None:
    t, p = make_task("x1"), 2
    await Producer(redis).publish(KEYS.task_stream(p), [t])
    cfg = ConsumerConfig(group=WORKERS_GROUP, consumer="w", block_ms=50)
    worker = Consumer(redis, KEYS, KEYS.all_tasks, cfg, expect=Task)
    await worker.ensure_groups()
    [d] = await worker.read()
    await worker.dead_letter(d, "task x1: bad spec")
    [(dl_id, letter)] = await list_dead_letters(redis, KEYS)
    assert letter.source_stream == KEYS.task_stream(p)
    assert await redis.xlen(KEYS.deadletter_of(p)) == 1
    assert await requeue(redis, KEYS, [dl_id]) == 1
    assert await redis.xlen(KEYS.deadletter_of(p)) == 0
    assert await redis.xlen(KEYS.task_stream(p)) == 2


async def test_broker_cli_covers_every_partition(redis, broker_url) -> None:
    for p in range(3):
        await Producer(redis).publish(KEYS.task_stream(p), [make_task(f"c{p}")])
    base = [sys.executable, "-m", "broker", "--redis-url", broker_url, "--run", KEYS.run]
    status = subprocess.run(
        [*base, "--partitions", "3", "status"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    for p in range(3):
        assert f"  stream {KEYS.task_stream(p)}: 1 entries" in status.stdout
        assert f"  stream {KEYS.trajectories(p)}: 0 entries" in status.stdout
    tail = subprocess.run([*base, "tail", "tasks:2"], capture_output=True, text=True, timeout=60)
    assert tail.returncode == 0, tail.stderr
    assert "task_id='c2'" in tail.stdout and "c0" not in tail.stdout


async def test_acl_user_on_the_cluster(redis_cluster: LocalCluster) -> None:
    redis_cluster.flush()
    for port in redis_cluster.live_ports():  # ACLs are per node
        redis_cluster.node(port).acl_setuser(
            "farm",
            enabled=True,
            passwords=["+s3cret"],
            keys=["{cl}:*", "{cl:*}:*"],
            commands=["+@all"],
        )
    port = redis_cluster.ports[0]
    client = await connect(RedisSettings.from_url(f"redis+cluster://farm:s3cret@127.0.0.1:{port}"))
    try:
        for p in range(3):
            assert await Producer(client).publish(KEYS.task_stream(p), [make_task(f"a{p}")])
        with pytest.raises(NoPermissionError):
            await client.set("outside-the-run", 1)
    finally:
        await client.aclose()
    wrong = RedisSettings.from_url(
        f"redis+cluster://farm:nope@127.0.0.1:{port}/0", retry_budget_s=0.3
    )
    with pytest.raises(RedisAuthFailed, match=r"farm:\*\*\*@"):
        await connect(wrong)


async def test_tls_cluster(tmp_path) -> None:
    """rediss+cluster:// with a CA file: TLS to every node the client discovers."""
    require(shutil.which("openssl") is not None, "openssl")
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
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    cluster = LocalCluster(tmp_path / "tls", tls=(cert, key))
    try:
        cluster.start()
        assert cluster.url.startswith("rediss+cluster://")
        client = await connect(RedisSettings.from_url(cluster.url, tls_ca_file=str(cert)))
        try:
            for p in range(3):
                await Producer(client).publish(KEYS.task_stream(p), [make_task(f"s{p}")])
            cfg = ConsumerConfig(group=WORKERS_GROUP, consumer="w", block_ms=50)
            worker = Consumer(client, KEYS, KEYS.all_tasks, cfg, expect=Task)
            await worker.ensure_groups()
            got = await worker.read(count=10)
            await worker.commit(got)
            assert sorted(d.message.task_id for d in got) == ["s0", "s1", "s2"]
            masters = {cluster.master_of(s) for s in KEYS.all_tasks}
            assert len(masters) >= 2  # TLS to more than the node named in the URL
        finally:
            await client.aclose()
        plain = RedisSettings.from_url(cluster.url.replace("rediss+", "redis+"), retry_budget_s=0.3)
        with pytest.raises(RedisUnavailable):
            await connect(plain)
    finally:
        cluster.stop()


async def test_wait_replicas_on_the_cluster_and_without_replicas(redis_cluster, redis_server):
    """With wait_replicas=1 a commit returns only once a replica holds it; on a node with
    no replica the same commit is an outage (RedisUnavailable), never a silent ack."""
    redis_cluster.flush()
    for url, replicated in ((redis_cluster.url, True), (redis_server.url, False)):
        redis = await connect(RedisSettings.from_url(url))
        try:
            await Producer(redis).publish(KEYS.tasks, [make_task("w0")])
            cfg = ConsumerConfig(
                group=WORKERS_GROUP,
                consumer="w",
                block_ms=50,
                settings=ConsumerSettings(wait_replicas=1, wait_timeout_ms=300),
            )
            c = Consumer(redis, KEYS, KEYS.all_tasks, cfg, expect=Task)
            await c.ensure_groups()
            [d] = await c.read()
            publish = [(KEYS.trajectories(0), make_group("w0"))]
            if not replicated:
                with pytest.raises(RedisUnavailable, match="reached 0 of 1 replicas"):
                    await c.commit([d], publish=publish)
                continue
            await c.commit([d], publish=publish)
            master = redis_cluster.master_of(KEYS.tasks)
            replica = redis_cluster.replica_of(master)
            # WAIT returned: the replica has the group, the ack and the seen mark already
            node = redis_cluster.node(replica)
            assert node.execute_command("READONLY")
            assert node.xlen(KEYS.trajectories(0)) == 1
            assert node.zscore(KEYS.seen(WORKERS_GROUP), "w0") is not None
            assert node.xpending(KEYS.tasks, WORKERS_GROUP)["pending"] == 0
        finally:
            await redis.aclose()


async def test_admission_waits_for_a_replica_on_the_cluster(redis_cluster, redis_server, caplog):
    """With wait_replicas=1 every acquire and release is followed by WAIT on the master
    that owns the budget (its WAIT count grows by two), so the replica holds the count when
    they return; on a node with no replica the slots are granted anyway, with a warning,
    as a retry would count them twice."""
    redis_cluster.flush()
    master = redis_cluster.node(redis_cluster.master_of(KEYS.admission))
    deadline = time.monotonic() + 30  # a fresh cluster's replica may still be syncing
    while (replica := master.info("replication").get("slave0", {})).get("state") != "online":
        assert time.monotonic() < deadline, "the budget's master has no online replica"
        time.sleep(0.1)

    def waits() -> int:
        return int(master.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

    redis = await connect(RedisSettings.from_url(redis_cluster.url))
    try:
        plain, replicated = AdmissionBudget(redis, KEYS), AdmissionBudget(redis, KEYS, 1, 300)
        await plain.set_limit(8)
        before = waits()
        assert await plain.try_acquire(3) == 3
        assert waits() == before  # no replicas asked for: no WAIT
        assert await replicated.try_acquire(4) == 4
        assert await replicated.release(2) == 5
        assert waits() == before + 2
        node = redis_cluster.node(int(replica["port"]))
        assert node.execute_command("READONLY")
        assert int(node.hget(KEYS.admission, "in_flight")) == 5
    finally:
        await redis.aclose()
    assert "replicas" not in caplog.text
    lone = await connect(RedisSettings.from_url(redis_server.url))
    try:
        budget = AdmissionBudget(lone, KEYS, 1, 100)
        await budget.set_limit(4)
        assert await budget.try_acquire(2) == 2
        assert await budget.in_flight() == 2
    finally:
        await lone.aclose()
    assert "admission update reached 0 of 1 replicas" in caplog.text


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (ClusterDownError("CLUSTERDOWN The cluster is down"), True),
        (MasterDownError("MASTERDOWN Link with MASTER is down"), True),
        (TryAgainError("TRYAGAIN"), True),
        (MovedError("3999 127.0.0.1:6381"), True),
        (ClusterError("TTL exhausted."), True),
        (SlotNotCoveredError('Slot "7" is not covered by the cluster.'), True),
        (RedisClusterException("Redis Cluster cannot be connected. Please provide ..."), True),
        (RedisClusterException("Keys in request don't hash to the same slot"), False),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), False),
    ],
)
def test_cluster_errors_translate_to_outage_or_command_failure(error, outage) -> None:
    """The failover test meets these for real; this pins each class (and the one message
    the cluster client gives an unreachable cluster) to the broker's error it becomes."""
    with pytest.raises(RedisUnavailable if outage else RedisCommandFailed):
        with redis_errors("reading"):
            raise error
