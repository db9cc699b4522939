"""Replay: the same data gives bit-identical weights (CPU, fixed seed), whether it comes
from a stream range or from archived segments; torchrun with 2 ranks (gloo) gives the
single-process weights up to floating-point tolerance."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from broker.archive import Archive
from broker.connection import RedisSettings, connect
from broker.keys import RunKeys
from broker.producer import Producer
from learner.checkpoint import latest_checkpoint, load_state
from tests.conftest import RedisServer, require
from tests.learner.factories import make_group

KEYS = RunKeys("replay")


async def seed_stream_and_archive(url: str, archive_dir: Path) -> None:
    groups = [
        make_group(
            f"r-{i:02d}", [[0.0, 1.0, 0.5], [1.0, 0.0, 0.0]][i % 2], turns=1 + i % 2, vocab=256
        )
        for i in range(12)
    ]
    redis = await connect(RedisSettings.from_url(url))
    await Producer(redis).publish(KEYS.trajectories(), groups)
    rows = await redis.xrange(KEYS.trajectories())
    Archive(archive_dir).append([(eid.decode(), dict(fields)) for eid, fields in rows])
    await redis.aclose()


def start_replay(
    model: Path, url: str, source: str, out: Path, launcher: list[str], *extra: str
) -> subprocess.Popen[str]:
    # torchrun's own parser takes "--run" for an abbreviation of its "--run-path": the run
    # name travels in FARM_RUN instead (docs/learner.md says so)
    cmd = [
        *launcher,
        "learner",
        "--model",
        str(model),
        "--redis-url",
        url,
        "--replay",
        source,
        "--checkpoint-dir",
        str(out),
        "--groups-per-batch",
        "4",
        "--micro-batch-size",
        "3",
        "--learning-rate",
        "5e-3",
        "--seed",
        "3",
        "--algorithm",
        "rebn",
        *extra,
    ]
    env = {**os.environ, "FARM_RUN": KEYS.run}
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(proc: subprocess.Popen[str], out: Path, records: list | None = None) -> Path:
    try:
        _, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and load_state(ckpt).step == 3
    if records is not None:
        records += [
            json.loads(line.split(" learner ", 1)[1])
            for line in stderr.splitlines()
            if '"event": "step"' in line
        ]
    return ckpt / "model.safetensors"


@pytest.mark.slow
def test_replay_is_bit_identical_and_torchrun_matches(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    asyncio.run(seed_stream_and_archive(redis_server.url, tmp_path / "archive"))
    single = [sys.executable, "-m"]
    runs = [
        start_replay(tiny_model_dir, redis_server.url, "stream:..", tmp_path / "a", single),
        start_replay(
            tiny_model_dir, redis_server.url, str(tmp_path / "archive"), tmp_path / "b", single
        ),
    ]
    a, b = finish(runs[0], tmp_path / "a"), finish(runs[1], tmp_path / "b")
    assert a.read_bytes() == b.read_bytes(), "same data, same seed: weights must be bit-identical"
    base = load_file(tiny_model_dir / "model.safetensors")
    trained = load_file(a)
    assert any(not torch.equal(base[k], trained[k]) for k in base), "replay changed nothing"

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    require(torchrun is not None, "torchrun")
    launcher = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m"]
    c = finish(
        start_replay(tiny_model_dir, redis_server.url, "stream:..", tmp_path / "c", launcher),
        tmp_path / "c",
    )
    distributed = load_file(c)
    for key, value in trained.items():
        # Every token now carries gradient (w = min(pi_prox/mu, 2), where the ratio to mu used
        # to clip most of these random-logprob tokens to none): more rounding goes through
        # Adam, whose normalisation magnifies it on near-zero gradients. A wrong shard moves
        # weights by up to the learning rate (5e-3).
        torch.testing.assert_close(distributed[key], value, rtol=1e-3, atol=1e-4)


@pytest.mark.slow
def test_every_loss_term_from_the_command_line_and_under_torchrun(
    redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Critic PPO with 2 epochs x 2 mini-batches, a KL reward penalty and an entropy bonus:
    the flags reach the loss, and 2 ranks (gloo) give the single-process weights."""
    asyncio.run(seed_stream_and_archive(redis_server.url, tmp_path / "archive"))
    extra = (
        "--algorithm",
        "ppo",
        "--ppo-epochs",
        "2",
        "--mini-batches",
        "2",
        "--kl-coef",
        "0.05",
        "--kl-mode",
        "reward",
        "--entropy-coef",
        "0.01",
        "--correction",
        "mis",
    )
    single: list[dict] = []
    a = finish(
        start_replay(
            tiny_model_dir,
            redis_server.url,
            "stream:..",
            tmp_path / "a",
            [sys.executable, "-m"],
            *extra,
        ),
        tmp_path / "a",
        single,
    )
    assert [r["optimizer_steps"] for r in single] == [4, 4, 4]
    assert all(r["value_loss"] > 0 for r in single)
    assert all(0.0 <= r["correction_fraction"] <= 1.0 for r in single)
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    require(torchrun is not None, "torchrun")
    launcher = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m"]
    c = finish(
        start_replay(
            tiny_model_dir, redis_server.url, "stream:..", tmp_path / "c", launcher, *extra
        ),
        tmp_path / "c",
    )
    trained, distributed = load_file(a), load_file(c)
    base = load_file(tiny_model_dir / "model.safetensors")
    for key, value in trained.items():
        # as above, over 12 AdamW steps; a wrong shard or mini-batch moves weights by up to
        # the learning rate (5e-3), far beyond this tolerance
        torch.testing.assert_close(distributed[key], value, rtol=1e-3, atol=1e-4)
    assert any(not torch.equal(base[k], trained[k]) for k in base)
