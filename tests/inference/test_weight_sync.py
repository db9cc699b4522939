"""The file weight-sync client against real servers: push, verify, failure reporting, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from transformers import AutoModelForCausalLM

from inference.config import WeightSyncConfig
from inference.errors import WeightSyncError
from inference.weight_sync import FileWeightSync
from tests.conftest import free_port
from tests.inference.conftest import teacher_forced_logprobs
from tests.inference.test_server import completion, get, post


async def test_push_saves_reloads_and_verifies_every_server(
    server_factory, model_dir: Path, other_model_dir: Path, tmp_path: Path
) -> None:
    servers = [await server_factory(api_key="k"), await server_factory(api_key="k")]
    sync = FileWeightSync(
        [s.url for s in servers],
        WeightSyncConfig(root_dir=tmp_path / "w", api_key="k", keep_versions=1),
    )
    model = AutoModelForCausalLM.from_pretrained(other_model_dir)
    path = await sync.push(model, model_dir, version=5)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(path) is not None  # a loadable HF directory
    body = completion([3, 4], max_tokens=6, ignore_eos=True)
    for server in servers:
        assert (await get(server.url + "/weight_info", token="k"))[1] == '{"weight_version": "5"}'
        assert (await get(server.url + "/is_paused", token="k"))[1] == '{"is_paused": false}'
        _, out = await post(server.url + "/v1/completions", body, token="k")
        choice = out["choices"][0]
        assert choice["weight_versions"][0]["version"] == "5"
        ref = teacher_forced_logprobs(other_model_dir, body["prompt"], choice["token_ids"])
        assert float((torch.tensor(choice["logprobs"]["token_logprobs"]) - ref).abs().max()) < 1e-4
        assert (
            REGISTRY.get_sample_value("farm_weight_sync_served_version", {"server": server.url})
            == 5
        )
    await sync.push(model, None, version=6)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [
        "v00000006"
    ]  # older versions pruned


async def test_a_server_that_cannot_take_the_update_is_reported(
    server_factory, other_model_dir: Path, tmp_path: Path
) -> None:
    good = await server_factory()
    dead = f"http://127.0.0.1:{free_port()}"
    config = WeightSyncConfig(root_dir=tmp_path, attempts=2, backoff_s=0.01, timeout_s=2)
    sync = FileWeightSync([good.url, dead], config)
    before = REGISTRY.get_sample_value("farm_weight_sync_failures_total", {"server": dead}) or 0
    with pytest.raises(WeightSyncError) as info:
        await sync.push(AutoModelForCausalLM.from_pretrained(other_model_dir), None, version=2)
    assert set(info.value.failures) == {dead} and info.value.version == 2
    assert (
        REGISTRY.get_sample_value("farm_weight_sync_failures_total", {"server": dead}) == before + 2
    )
    assert (await get(good.url + "/weight_info"))[1] == '{"weight_version": "2"}'


async def test_rejected_weights_keep_the_old_version_and_resume(
    server_factory, tmp_path: Path
) -> None:
    server = await server_factory()
    wrong = AutoModelForCausalLM.from_pretrained(server.config.model)
    wrong.resize_token_embeddings(300)  # a different vocabulary: the server must refuse it
    sync = FileWeightSync([server.url], WeightSyncConfig(root_dir=tmp_path, attempts=1))
    with pytest.raises(WeightSyncError, match="shape"):
        await sync.push(wrong, None, version=9)
    assert (await get(server.url + "/weight_info"))[1] == '{"weight_version": "0"}'
    assert (await get(server.url + "/is_paused"))[1] == '{"is_paused": false}'  # never left paused
