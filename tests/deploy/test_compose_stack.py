"""The compose stack's CPU profile brought up for real, scaled from one worker to four mid-run.

`farm images build` makes the images offline (cached by content tag, so only the first
run builds). docker-compose then starts Redis, the tiny model's writer, the CPU policy
server, the CPU learner, one worker and Prometheus, in a project of the test's own. The
tasks are `slow-toy` (tests/deploy/compose_env.py): each step waits STEP_S like a tool
call, so one worker (TASKS_PER_WORKER tasks at once) cannot keep up with the admission
budget of LIMIT tasks, and the tasks stream's consumer-group lag stays high.
`up --scale worker=4` mid-run gives the workers room for the whole budget: the lag
falls to about zero, and the learner finishes its STEPS. Prometheus found the four
workers, the learner and the policy server through Docker's DNS, and holds the lag.

Then the books: every task published became exactly one group, published once; no
group was trained twice (the learner's checkpoint lists the group ids of each step);
every group the learner took was taken once, and the rest is in flight (read and
unacked, or unread); nothing was dead-lettered; issued minus consumed never exceeded
the budget; all four workers produced. `down -v` always, passed or failed.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import yaml

from broker.codec import decode
from broker.keys import LEARNER_GROUP, WORKERS_GROUP, RunKeys
from broker.messages import Task, TrajectoryGroup
from learner.checkpoint import latest_checkpoint, load_state
from tests.conftest import free_port, require
from tests.deploy.compose import COMPOSE, Stack, compose_cli, states

pytestmark = [pytest.mark.slow, pytest.mark.docker]

RUN = "compose"
KEYS = RunKeys(RUN)
GROUP_SIZE, GROUPS_PER_BATCH, MAX_STALENESS = 4, 4, 3
LIMIT = (MAX_STALENESS + 1) * GROUPS_PER_BATCH  # tasks in flight (push every step)
TASKS_PER_WORKER = 4  # concurrency = TASKS_PER_WORKER x GROUP_SIZE episodes
STEP_S = 2.0  # one worker: ~TASKS_PER_WORKER / STEP_S tasks per second
# Long enough that the run outlasts the four workers' samples even when they join late:
# measured, 44 of the run's 188 groups were consumed when they joined and 104 after their
# samples, so one worker (2 groups a second) could still take 40 s longer to be joined.
STEPS = 36
SCALED = 4
ENV_FILE = Path(__file__).with_name("compose_env.py")


def _docker_engine() -> bool:
    """`docker info` answers (the CLI: docker-py leaks a socket when the engine is absent)."""
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "info"], capture_output=True, timeout=60)
    return probe.returncode == 0


@dataclass(frozen=True)
class Deployed:
    """The test's compose project and where to look at it from the host."""

    stack: Stack
    ckpt: Path  # the learner's checkpoint directory (bind-mounted)
    prometheus_port: int  # Prometheus on 127.0.0.1


@pytest.fixture
def deployed(tmp_path: Path) -> Iterator[Deployed]:
    require(_docker_engine(), "a Docker engine")
    compose_cli()
    from farm.images import PROMETHEUS, REDIS, WORKER, build

    started = time.monotonic()
    tags = build(quiet=True, env_file=None)  # a few hashes when the images exist
    print(f"images ready in {time.monotonic() - started:.0f} s")
    models, ckpt, tasks = tmp_path / "models", tmp_path / "ckpt", tmp_path / "tasks"
    for d in (models, ckpt, tasks):
        d.mkdir()
        d.chmod(0o777)  # the containers' user (uid 10001) writes the checkpoints
    spec = "slow-toy@" + json.dumps({"step_s": STEP_S})
    (tasks / "tasks.jsonl").write_text(json.dumps({"env_spec": spec}) + "\n")
    override = tmp_path / "override.yml"
    override.write_text(yaml.safe_dump(_override(tasks, ckpt)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {
        "FARM_RUN": RUN,
        "FARM_MODEL_DIR": str(models),
        "FARM_PROMETHEUS_PORT": str(free_port()),
        WORKER.variable: tags[WORKER],
        REDIS.variable: tags[REDIS],
        PROMETHEUS.variable: tags[PROMETHEUS],
    }
    made = Stack(f"rf-test-{uuid.uuid4().hex[:8]}", [COMPOSE, override], env)
    try:
        yield Deployed(made, ckpt, int(env["FARM_PROMETHEUS_PORT"]))
    finally:
        print(made.logs(tail=25))  # shown when the test failed
        made.down()


def _override(tasks: Path, ckpt: Path) -> dict[str, object]:
    """The test's settings on top of the shipped file: small run, slow tasks, host paths."""
    plugin = {"PYTHONPATH": "/opt/plugins", "FARM_ENV_MODULES": "compose_env"}
    learner_env = {
        **plugin,
        "FARM_GROUP_SIZE": GROUP_SIZE,
        "FARM_GROUPS_PER_BATCH": GROUPS_PER_BATCH,
        "FARM_MAX_STALENESS": MAX_STALENESS,
        "FARM_MAX_STEPS": STEPS,
        "FARM_CHECKPOINT_INTERVAL": 5,
        # the books below read the run's whole history off the streams: trim only at start
        "FARM_STREAM_TRIM_INTERVAL_S": 3600,
    }
    worker_env = {**plugin, "FARM_CONCURRENCY": TASKS_PER_WORKER * GROUP_SIZE, "FARM_MAX_TOKENS": 1}
    mount = f"{ENV_FILE}:/opt/plugins/compose_env.py:ro"
    return {
        "services": {
            "redis": {"ports": ["127.0.0.1::6379"]},
            "worker": {
                "environment": {k: str(v) for k, v in worker_env.items()},
                "volumes": [mount],
            },
            "learner-cpu": {
                "environment": {k: str(v) for k, v in learner_env.items()},
                "volumes": [f"{tasks}:/config:ro", f"{ckpt}:/checkpoints", mount],
            },
        }
    }


def _workers_group(r: redis.Redis) -> dict | None:
    for g in r.xinfo_groups(KEYS.tasks) if r.exists(KEYS.tasks) else []:
        if g["name"] == WORKERS_GROUP.encode():
            return g
    return None


def _learner_read(r: redis.Redis) -> int:
    if not r.exists(KEYS.trajectories()):
        return 0
    for g in r.xinfo_groups(KEYS.trajectories()):
        if g["name"] == LEARNER_GROUP.encode():
            return int(g["entries-read"] or 0)
    return 0


class Sampler:
    """Task lag and issued-minus-consumed, sampled every 0.25 s while the test waits."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.in_flight: list[int] = []  # tasks issued minus groups the learner read

    def until(self, done: Callable[[], bool], within_s: float, what: str) -> list[int]:
        """Sample until `done()`; returns the task-lag samples taken."""
        lags, deadline = [], time.monotonic() + within_s
        while not done():
            assert time.monotonic() < deadline, f"{what} within {within_s} s"
            with self.r.pipeline(transaction=True) as pipe:  # one instant for both numbers
                pipe.xlen(KEYS.tasks)
                pipe.exists(KEYS.trajectories())
                issued, _ = pipe.execute()
            self.in_flight.append(int(issued) - _learner_read(self.r))
            group = _workers_group(self.r)
            if group is not None and group["lag"] is not None:
                lags.append(int(group["lag"]))
            time.sleep(0.25)
        return lags


def _consumers(r: redis.Redis) -> int:
    group = _workers_group(r)
    return 0 if group is None else int(group["consumers"])


def _groups_published(r: redis.Redis) -> int:
    return int(r.xlen(KEYS.trajectories())) if r.exists(KEYS.trajectories()) else 0


def _learner_exited(learner: list[str]) -> bool:
    """Polled by container id: `learner` is `Stack.ids("learner-cpu")`, taken once."""
    found = states(learner)
    return bool(found) and found[0]["Status"] == "exited"


def _prometheus(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())["data"]["result"]


def _workers_scraped(port: int) -> int:
    try:
        result = _prometheus(port, 'count(up{job="farm-workers"} == 1)')
    except OSError:
        return 0
    return int(float(result[0]["value"][1])) if result else 0


def _check_prometheus(port: int) -> None:
    """Prometheus scraped every role through Docker's DNS, and holds the tasks lag that the
    learner exported while it ran (range queries: the learner's series are stale now)."""
    for job in ("farm-learner", "farm-inference"):
        seen = _prometheus(port, f'max_over_time(up{{job="{job}"}}[10m])')
        assert seen and float(seen[0]["value"][1]) == 1, f"{job} never scraped"
    query = f'max_over_time(farm_stream_lag_entries{{group="{WORKERS_GROUP}"}}[10m])'
    lag = _prometheus(port, query)
    assert lag and float(lag[0]["value"][1]) > 0, "no tasks lag in Prometheus"


@pytest.mark.timeout(1500)
def test_compose_stack_scales_workers_mid_run_and_keeps_the_books(deployed: Deployed) -> None:
    started, stack = time.monotonic(), deployed.stack
    stack.run("--profile", "cpu", "up", "-d", "--scale", "worker=1", timeout=600)
    with redis.Redis(port=stack.port("redis", 6379), socket_timeout=10) as r:
        _scale_mid_run(deployed, r, started)
        _check_books(r, deployed.ckpt)


def _scale_mid_run(deployed: Deployed, r: redis.Redis, started: float) -> None:
    stack, port, sampler = deployed.stack, deployed.prometheus_port, Sampler(r)
    learner = stack.ids("learner-cpu")
    # One worker, in its steady state: it took tasks and published groups.
    sampler.until(lambda: _groups_published(r) >= 2 * TASKS_PER_WORKER, 300, "first groups")
    t = time.monotonic() + 4 * STEP_S
    before = sampler.until(lambda: time.monotonic() > t, 60, "one-worker samples")
    assert _consumers(r) == 1 and not _learner_exited(learner)

    stack.run("up", "-d", "--no-deps", "--no-recreate", "--scale", f"worker={SCALED}", "worker")
    sampler.until(lambda: _consumers(r) == SCALED, 240, f"{SCALED} consumers")
    assert not _learner_exited(learner), "the run ended before the scaled workers joined"
    scaled_at = _learner_read(r)
    t = time.monotonic() + 4 * STEP_S
    after = sampler.until(lambda: time.monotonic() > t, 60, "four-worker samples")
    # (with the learner gone no task would be issued, and the lag would be 0 for nothing)
    assert not _learner_exited(learner), "the run ended while the four workers were sampled"
    sampled_to = _learner_read(r)
    try:
        sampler.until(lambda: _learner_exited(learner), 400, "the run's end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.stacks('learner-cpu')}") from None
    sampler.until(lambda: _workers_scraped(port) == SCALED, 90, "Prometheus scraping 4 workers")
    _check_prometheus(port)
    print(
        f"run took {time.monotonic() - started:.0f} s; of {_learner_read(r)} groups, "
        f"{scaled_at} were consumed when 4 workers ran and {sampled_to} after their samples; "
        f"lag before {before}, after {after}"
    )

    # One worker holds TASKS_PER_WORKER of the LIMIT: the rest (less what waits for the
    # learner) waits for a worker, more than another worker could take. Four hold them all.
    assert statistics.median(before) > TASKS_PER_WORKER, before
    assert statistics.median(after) <= 1, after
    assert max(sampler.in_flight) <= LIMIT, "the admission budget did not hold across pods"
    assert stack.state("learner-cpu")[0]["ExitCode"] == 0, stack.logs("learner-cpu")
    # The workers finish what they hold; the learner issues no more.
    sampler.until(
        lambda: (
            (g := _workers_group(r)) is not None and int(g["pending"]) == 0 and int(g["lag"]) == 0
        ),
        120,
        "workers drained",
    )


def _check_books(r: redis.Redis, ckpt: Path) -> None:
    tasks = [decode(f, expect=Task).task_id for _, f in r.xrange(KEYS.tasks)]  # type: ignore[union-attr]
    groups = [decode(f, expect=TrajectoryGroup) for _, f in r.xrange(KEYS.trajectories())]
    state = load_state(latest_checkpoint(ckpt))  # type: ignore[arg-type]
    trained = Counter(g for step in state.trained for g in step)
    published = Counter(g.group_id for g in groups)  # type: ignore[union-attr]
    learner = next(g for g in r.xinfo_groups(KEYS.trajectories()) if g["name"] == b"learner")
    read, pending, lag = (int(learner[k]) for k in ("entries-read", "pending", "lag"))

    assert len(set(tasks)) == len(tasks), "a task id was issued twice"
    assert max(published.values()) == 1, "a group was published twice"
    assert set(published) == set(tasks), "a task was lost (or a group made up)"
    assert r.xlen(KEYS.deadletter) == 0
    assert state.step == STEPS and len(state.trained) == STEPS
    assert max(trained.values()) == 1, "a group was trained twice"
    assert set(trained) <= set(published)
    # Every group the learner took (trained, or in a batch with nothing to train) was
    # taken once; the rest is in flight: read but unacked, or not yet read.
    assert state.counters["groups"] == read - pending, state.counters
    assert sum(trained.values()) <= state.counters["groups"]
    assert read + lag == len(groups)
    assert len({g.worker_id for g in groups}) == SCALED, "not every scaled worker produced"  # type: ignore[union-attr]
