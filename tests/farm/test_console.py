"""The console (prefixed lines, live status on a TTY, plain lines elsewhere, log files)
and the status view's reading of a real Prometheus exposition."""

from __future__ import annotations

import io
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from broker.connection import RedisSettings
from broker.keys import RunKeys
from farm.console import Console
from farm.view import FarmStatus, FarmView, parse_metrics, total


def test_plain_output_prefixes_lines_and_prints_status_when_it_changes(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(out, log_dir=tmp_path / "logs")
    console.line("worker-0", "hello")
    console.status("step 1")
    console.status("step 1")
    console.status("step 2")
    console.close()
    assert out.getvalue().splitlines() == [
        "worker-0   | hello",
        "status     | step 1",
        "status     | step 2",
    ]
    assert (tmp_path / "logs" / "worker-0.log").read_text() == "hello\n"


def test_quiet_console_keeps_children_in_files_only(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(out, log_dir=tmp_path, echo_children=False)
    console.line("learner", "step 1")
    console.line("farm", "all processes started")
    console.close()
    assert out.getvalue() == "farm       | all processes started\n"
    assert (tmp_path / "learner.log").read_text() == "step 1\n"


def _drain(master: int) -> bytes:
    """Everything the closed slave side wrote: one read may return only part of it."""
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the slave is closed and the buffer is empty
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def test_tty_keeps_the_status_line_at_the_bottom() -> None:
    """On a real pseudo-terminal, log lines go above the status, which is redrawn."""
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=True) as tty:
            console = Console(tty)
            assert console.tty
            console.status("step 1")
            console.line("learner", "log line")
            console.close()
        written = _drain(master).decode().replace("\r\n", "\n")
    finally:
        os.close(master)
    clear = "\r\x1b[2K"
    assert written == f"{clear}step 1{clear}learner    | log line\nstep 1\n"


def test_view_sums_samples_across_processes_and_label_sets() -> None:
    registry = CollectorRegistry()
    episodes = Counter("farm_worker_episodes_total", "e", ["env", "outcome"], registry=registry)
    episodes.labels("toy", "ok").inc(3)
    episodes.labels("toy", "error").inc(1)
    containers = Gauge("farm_sandbox_containers", "c", ["state"], registry=registry)
    containers.labels("idle").set(2)
    Histogram("farm_learner_staleness_steps", "s", registry=registry).observe(1)
    samples = parse_metrics(generate_latest(registry).decode())
    assert total(samples, "farm_worker_episodes_total") == 4
    assert total(samples, "farm_worker_episodes_total", outcome="ok") == 3
    assert total(samples, "farm_learner_staleness_steps_count") == 1
    assert total(samples, "farm_worker_env_steps_total") is None


async def test_view_of_unreachable_processes_reports_unknowns() -> None:
    view = FarmView({"worker-0": "http://127.0.0.1:9/metrics"}, None, RunKeys("x"), timeout_s=1)
    try:
        status = await view.poll()
    finally:
        await view.close()
    assert status.learner_step is None and status.episodes_per_s is None
    assert "step - | reward - | eps/s -" in status.line()


async def test_view_of_a_lost_redis_reports_unknowns() -> None:
    lost = RedisSettings(url="redis://127.0.0.1:1/0").client()  # nothing listens on port 1
    view = FarmView({}, lost, RunKeys("x"), timeout_s=1)
    try:
        status = await view.poll()
    finally:
        await view.close()
        await lost.aclose()
    assert status.tasks_lag is None and status.admission is None and status.dead_letters is None
    assert "lag tasks -/traj -" in status.line()


def test_status_line_shows_every_field() -> None:
    status = FarmStatus(
        elapsed_s=12,
        learner_step=5,
        reward=0.25,
        episodes_per_s=3.5,
        tokens_per_s=100,
        staleness_mean=0.5,
        policy_version=5,
        served_versions=(4, 5),
        sandbox={"idle": 2, "busy": 1},
        tasks_lag=3,
        tasks_pending=2,
        trajectories_lag=1,
        dead_letters=0,
        admission=(6, 8),
    )
    assert status.line() == (
        "t=   12s | step 5 | reward 0.250 | eps/s 3.50 | tok/s 100 | lag tasks 3/traj 1 | "
        "pending 2 | stale 0.50 | version 5 (served 4,5) | sandbox busy=1 idle=2 | "
        "admission 6/8 | dead 0"
    )


def test_status_line_shows_the_latest_dead_letter_clipped() -> None:
    reason = "{run}:tasks 1-0: task t: bad kwargs for 'codegym': " + "x" * 300
    line = FarmStatus(elapsed_s=1, dead_letters=3, latest_dead_letter=reason).line()
    tail = line.split(" | ")[-1]
    assert tail.startswith("dead 3 (latest: {run}:tasks 1-0: task t: bad kwargs for 'codegym'")
    assert tail.endswith("...)") and len(tail) == len("dead 3 (latest: )") + 160


async def test_view_sums_lag_and_pending_over_every_partition(redis_server) -> None:
    from broker.connection import RedisSettings, connect
    from broker.keys import LEARNER_GROUP, WORKERS_GROUP
    from broker.messages import Task
    from broker.producer import Producer

    keys = RunKeys("parts", partitions=3)
    redis = await connect(RedisSettings.from_url(redis_server.url))
    view = FarmView({}, redis, keys)
    try:
        for p, stream in enumerate(keys.all_tasks):  # partition p: p + 1 tasks, one delivered
            await Producer(redis).publish(
                stream, [Task(f"t{p}{i}", "toy@{}", 2, i, 0) for i in range(p + 1)]
            )
            await redis.xgroup_create(stream, WORKERS_GROUP, id="0")
            await redis.xreadgroup(WORKERS_GROUP, "w", {stream: ">"}, count=1)
        for stream in keys.all_trajectories:
            await redis.xgroup_create(stream, LEARNER_GROUP, id="0", mkstream=True)
        status = await view.poll()
    finally:
        await view.close()
        await redis.aclose()
    # 6 tasks, 3 delivered and pending, 3 not yet delivered; no trajectories yet.
    assert (status.tasks_lag, status.tasks_pending, status.trajectories_lag) == (3, 3, 0)
    assert "lag tasks 3/traj 0 | pending 3" in status.line()


async def test_view_reads_dead_letters_from_redis(redis_server) -> None:
    from broker.connection import RedisSettings, connect
    from broker.consumer import Consumer, ConsumerConfig
    from broker.keys import WORKERS_GROUP
    from broker.messages import Task
    from broker.producer import Producer

    keys = RunKeys("view")
    redis = await connect(RedisSettings.from_url(redis_server.url))
    view = FarmView({}, redis, keys)
    try:
        consumer = Consumer(redis, keys, [keys.tasks], ConsumerConfig(WORKERS_GROUP, "w"), Task)
        await consumer.ensure_groups()
        assert (await view.poll()).line().endswith("dead 0")
        await Producer(redis).publish(keys.tasks, [Task("t1", "nope", 2, 0, 0)])
        [delivery] = await consumer.read(count=1, block_ms=100)
        await consumer.dead_letter(delivery, "task t1: unknown environment 'nope'")
        line = (await view.poll()).line()
    finally:
        await view.close()
        await redis.aclose()
    assert line.endswith(
        f"dead 1 (latest: {keys.tasks} {delivery.entry_id}: task t1: unknown environment 'nope')"
    )


async def test_served_versions_come_from_the_learner_where_servers_export_none() -> None:
    """vLLM exports no farm_inference_weight_version: the status shows the versions the
    learner verified on each server (farm_weight_sync_served_version{server})."""
    registry = CollectorRegistry()
    served = Gauge("farm_weight_sync_served_version", "v", ["server"], registry=registry)
    served.labels("http://a:8000").set(7)
    served.labels("http://b:8000").set(6)
    runner, url = await _serve(registry)
    view = FarmView({"learner": url}, None, RunKeys("x"))
    try:
        status = await view.poll()
    finally:
        await view.close()
        await runner.cleanup()  # type: ignore[attr-defined]
    assert status.served_versions == (6, 7)


async def _serve(registry: CollectorRegistry) -> tuple[object, str]:
    from aiohttp import web

    from tests.conftest import free_port

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/metrics"


async def test_status_line_shows_the_periods_zero_variance_share_and_common_reward() -> None:
    """Issue 42: between two polls 40 groups arrive, 30 of them all scoring 1.0."""
    registry = CollectorRegistry()
    groups = Counter("farm_learner_groups", "g", registry=registry)
    zero = Counter("farm_learner_zero_variance_groups", "z", registry=registry)
    reward = Counter("farm_learner_zero_variance_reward", "r", registry=registry)
    groups.inc(100)
    zero.inc(10)  # before the period: not counted in its share
    runner, url = await _serve(registry)
    view = FarmView({"learner": url}, None, RunKeys("x"))
    try:
        first = await view.poll()
        groups.inc(40)
        zero.inc(30)
        reward.inc(30.0)
        solved = await view.poll()
        groups.inc(10)
        zero.inc(10)
        hard = await view.poll()
        groups.inc(10)
        idle = await view.poll()
    finally:
        await view.close()
        await runner.cleanup()  # type: ignore[attr-defined]
    assert first.zero_variance_share is None and "zero-var" not in first.line()
    assert solved.zero_variance_share == 0.75 and solved.zero_variance_reward == 1.0
    assert "| reward - | zero-var 75% (all 1.0: solved) | eps/s" in solved.line()
    assert "zero-var 100% (all 0.0: too hard)" in hard.line()
    assert "zero-var 0% |" in idle.line()
    mixed = FarmStatus(elapsed_s=1, zero_variance_share=0.5, zero_variance_reward=0.25)
    assert "zero-var 50% (mean reward 0.25)" in mixed.line()


async def test_each_new_evaluation_becomes_one_line_per_set(redis_server) -> None:
    from broker.connection import connect
    from broker.status import format_state, publish_eval, run_state

    keys = RunKeys("evals")
    summary = {
        "event": "eval",
        "step": 40,
        "version": 40,
        "weight_versions": [38, 40],
        "sets": {
            "gsm8k": {"rows": 200, "mean_at_k": 0.5123, "pass_at_1": 0.5, "pass_at_4": 0.75},
            "gsm8k/math": {"rows": 200, "mean_at_k": 0.5, "pass_at_1": 0.5, "pass_at_4": 0.7},
            "held": {"rows": 3, "mean_at_k": 1.0, "pass_at_1": 1.0},
        },
    }
    redis = await connect(RedisSettings.from_url(redis_server.url))
    view = FarmView({}, redis, keys)
    try:
        assert (await view.poll()).new_eval == ()  # none yet
        await publish_eval(redis, keys, summary)
        new = (await view.poll()).new_eval
        again = (await view.poll()).new_eval
        state = await run_state(redis, keys)
    finally:
        await view.close()
        await redis.aclose()
    assert new == (
        "eval gsm8k at step 40: mean@4 0.512, pass@4 0.750, rows 200, weights v38..40",
        "eval held at step 40: mean@1 1.000, pass@1 1.000, rows 3, weights v38..40",
    )
    assert again == ()  # printed once
    assert f"\n  last {new[0]}\n  last {new[1]}" in format_state(state)  # `farm status`
