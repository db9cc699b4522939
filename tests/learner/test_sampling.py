"""Dynamic sampling: zero-variance groups never shrink a batch; admission follows the filter rate."""

from __future__ import annotations

import asyncio

from broker.connection import RedisSettings, connect
from broker.consumer import ConsumerConfig
from broker.keys import LEARNER_GROUP, RunKeys
from broker.messages import ErrorCategory
from broker.producer import Producer
from learner.algorithms import Algorithm
from learner.batch import BatchRules, filter_reason
from learner.config import LearnerConfig
from learner.sampling import DynamicSampling
from learner.source import LiveSource
from learner.tasks import CurriculumRules, HorizonSchedule, TaskFeeder, TaskRow, TaskSampler
from tests.conftest import RedisServer
from tests.learner.factories import make_group

RULES = BatchRules(Algorithm.GRPO, 1.0, max_staleness=1, skip_zero_variance=True)


def test_filter_reasons() -> None:
    assert filter_reason(make_group("ok", [0.0, 1.0]), RULES) is None
    assert filter_reason(make_group("flat", [1.0, 1.0]), RULES) == "zero_variance"
    infra = make_group("infra", [0.0, 1.0], error=ErrorCategory.SANDBOX)
    assert filter_reason(infra, RULES) == "infra"
    reinforce = BatchRules(Algorithm.REINFORCE, 1.0, 1, skip_zero_variance=True)
    assert filter_reason(make_group("flat", [1.0, 1.0]), reinforce) is None  # defect A


def test_batch_length_rate_and_over_issue_by_hand() -> None:
    flat, ok = make_group("flat", [1.0, 1.0]), make_group("ok", [0.0, 1.0])
    ds = DynamicSampling(
        lambda g: filter_reason(g, RULES), groups_per_batch=2, max_factor=4.0, steps=2
    )
    assert ds.batch_length([flat, ok, flat], 2) is None  # one group counts: keep reading
    assert ds.batch_length([flat, ok, flat, ok, ok], 2) == 4  # up to the second that counts
    assert ds.batch_length([flat] * 9, 2) == 8  # at most 4 x 2 groups, however few count
    assert ds.admission_limit() == 2 * 2  # nothing measured: steps x groups_per_batch
    assert ds.observe([flat, ok, flat, ok]) == 2
    # rate 1/2: a step consumes ceil(2 / (1 - 1/2)) = 4 groups; the limit holds 2 steps of them
    assert ds.rate == 0.5 and ds.groups_per_step() == 4 and ds.admission_limit() == 8
    ds.observe([flat] * 12)  # rate 14/16: 2 / (1/8) = 16 groups, capped at 4 x 2 = 8
    assert ds.groups_per_step() == 8


def _cfg(**flags: object) -> LearnerConfig:
    return LearnerConfig.load({"model": "/m", **flags}, environ={})


def test_admission_accounts_for_the_push_interval() -> None:
    # a task may sample weights push_interval - 1 steps older than the learner's step
    assert _cfg(max_staleness=2, push_interval=1).admission_steps == 3
    assert _cfg(max_staleness=2, push_interval=2).admission_steps == 2
    assert _cfg(max_staleness=2, push_interval=0).admission_steps == 3
    cfg = _cfg(max_staleness=1, push_interval=5, groups_per_batch=4)
    assert cfg.admission_limit == 4  # floor: one batch at a time


async def test_live_batches_are_filled_with_informative_groups(redis_server: RedisServer) -> None:
    keys = RunKeys("dyn")
    redis = await connect(RedisSettings.from_url(redis_server.url))
    try:
        groups = [
            make_group(f"d-{i}", [1.0, 1.0] if i % 2 == 0 else [0.0, 1.0], vocab=256)
            for i in range(6)
        ]
        await Producer(redis).publish(keys.trajectories(), groups)
        ds = DynamicSampling(lambda g: filter_reason(g, RULES), 2, 4.0, steps=2)
        sampler = TaskSampler([TaskRow("toy@{}")], 0, CurriculumRules())
        feeder = TaskFeeder(redis, keys, sampler, HorizonSchedule(), group_size=2, limit=4)
        await feeder.start(0)
        config = ConsumerConfig(group=LEARNER_GROUP, consumer="learner", block_ms=200)
        source = LiveSource(redis, keys, config, feeder, 256, sampling=ds)
        await source.start()
        batch = await source.next_batch(2, 0, 0, asyncio.Event())
        assert batch is not None
        assert [g.group_id for g in batch.groups] == ["d-0", "d-1", "d-2", "d-3"]
        # half the groups were filtered: the budget now admits 2 steps x 4 groups
        assert feeder.limit == 8 and await feeder.budget.limit() == 8
    finally:
        await redis.aclose()
