"""The CPU server's NCCL routes receive over a real gloo group, as vLLM's worker does over NCCL.

Real server processes, a real trainer (`NcclWeightSync` + `NcclTransport` over gloo), the tiny
model. After a push the servers generate with exactly the pushed weights; after a failed one
(a trainer killed mid-broadcast, metadata the model lacks, a stream that disagrees with its
metadata, a trainer that never joins) they keep their old weights and label and take a new
group and push.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inference.config import WeightSyncConfig
from inference.errors import WeightSyncError
from inference.nccl import NcclTransport, WeightStream, gloo_trainer_init
from inference.weight_sync import NcclWeightSync
from tests.conftest import free_port
from tests.inference.conftest import teacher_forced_logprobs
from tests.inference.test_server import completion, get, post


def gloo_sync(urls: list[str], timeout_s: float = 30) -> NcclWeightSync:
    transport = NcclTransport("127.0.0.1", free_port(), trainer_init=gloo_trainer_init(timeout_s))
    return NcclWeightSync(urls, WeightSyncConfig(root_dir=Path("/nonexistent")), transport)


async def serves(url: str, model: Path, version: str) -> None:
    """The server reports `version` and its logprobs are `model`'s, teacher-forced."""
    assert (await get(url + "/weight_info"))[1] == f'{{"weight_version": "{version}"}}'
    body = completion([7, 8], max_tokens=5, ignore_eos=True)
    status, out = await post(url + "/v1/completions", body)
    assert status == 200, out
    lp = torch.tensor(out["choices"][0]["logprobs"]["token_logprobs"])
    ref = teacher_forced_logprobs(model, body["prompt"], out["choices"][0]["token_ids"])
    assert float((lp - ref).abs().max()) < 1e-4


async def test_servers_serve_exactly_what_the_trainer_broadcast(
    process_factory, model_dir: Path, other_model_dir: Path
) -> None:
    urls = [p.url for p in process_factory(2)]
    sync = gloo_sync(urls)
    await asyncio.wait_for(sync.init(), 60)
    assert sync.rank_offsets == [1, 2] and sync.world_size == 3
    # the group is reused: a second version goes over the same one
    for version, model in ((3, other_model_dir), (4, model_dir)):
        await asyncio.wait_for(sync.push(load_file(model / "model.safetensors"), version), 60)
        for url in urls:
            await serves(url, model, str(version))
            assert (await get(url + "/is_paused"))[1] == '{"is_paused": false}'
    # out of order is refused: the session check is real
    status, _ = await post(urls[0] + "/finish_weight_update", {"weight_version": "9"})
    assert status == 409 and (await get(urls[0] + "/weight_info"))[1].endswith('"4"}')
    sync.close()


async def test_a_trainer_killed_mid_broadcast_leaves_the_old_version(
    process_factory, model_dir: Path, other_model_dir: Path
) -> None:
    (server,) = process_factory(1, ["--weight-transfer-timeout-s", "20"])
    weights = other_model_dir / "model.safetensors"
    args = [server.url, str(free_port()), str(weights), "5"]
    trainer = subprocess.run(
        [sys.executable, "-m", "tests.inference.gloo_trainer", *args], timeout=120, check=False
    )
    assert trainer.returncode == 17  # it died inside the broadcast, 5 tensors sent
    assert server.proc.poll() is None
    # the session is gone: a new update needs a new group; the dead trainer left it paused
    status, body = await post(server.url + "/start_weight_update")
    assert status == 409 and "not initialised" in body["error"]["message"]
    assert (await post(server.url + "/resume"))[0] == 200
    await serves(server.url, model_dir, "0")
    sync = gloo_sync([server.url])
    await asyncio.wait_for(sync.init(), 60)
    await asyncio.wait_for(sync.push(load_file(weights), 5), 60)
    await serves(server.url, other_model_dir, "5")


async def test_bad_metadata_is_refused_and_a_new_group_works(
    process_factory, model_dir: Path, other_model_dir: Path
) -> None:
    (server,) = process_factory(1, ["--weight-transfer-timeout-s", "20"])
    tensors = load_file(other_model_dir / "model.safetensors")
    stream = WeightStream.of(tensors)
    wrong_shape = dataclasses.replace(stream, shapes=((3, 3), *stream.shapes[1:]))
    # announced right, produced wrong: the trainer stops before sending what it did not announce
    swapped = dataclasses.replace(stream, produce=lambda: reversed(list(tensors.values())))
    sync = gloo_sync([server.url])  # one trainer, as the learner: init again on the same port
    for bad, why in ((wrong_shape, "does not match the model"), (swapped, "was announced as")):
        await asyncio.wait_for(sync.init(), 60)
        with pytest.raises(WeightSyncError) as err:
            await asyncio.wait_for(sync.push(bad, 7), 60)
        assert why in str(err.value) and not sync.ready
        assert server.proc.poll() is None
        await serves(server.url, model_dir, "0")
        with pytest.raises(WeightSyncError, match="call init"):
            await sync.push(tensors, 7)
    await asyncio.wait_for(sync.init(), 60)
    await asyncio.wait_for(sync.push(tensors, 8), 60)
    await serves(server.url, other_model_dir, "8")


async def test_a_trainer_that_never_comes_times_out_the_join(
    server_factory, other_model_dir: Path
) -> None:
    server = await server_factory(weight_transfer_timeout_s=3.0)
    info = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
    }
    joining = asyncio.create_task(
        post(server.url + "/init_weight_transfer_engine", {"init_info": info})
    )
    await asyncio.sleep(0.3)
    # the join waits in a thread: the server answers meanwhile
    assert (await get(server.url + "/weight_info"))[0] == 200 and not joining.done()
    status, body = await joining
    assert status == 500 and "group not formed" in body["error"]["message"]
    assert (await post(server.url + "/start_weight_update"))[0] == 409
    sync = gloo_sync([server.url])
    await asyncio.wait_for(sync.init(), 60)
    await asyncio.wait_for(sync.push(load_file(other_model_dir / "model.safetensors"), 2), 60)
    await serves(server.url, other_model_dir, "2")
    sync.close()
