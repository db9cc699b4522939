"""LoRA on the CPU policy server: vLLM's adapter routes, generation with base + adapter equal to
peft's, the errors, and the adapter-sync client that pushes and verifies adapters."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from prometheus_client import REGISTRY

from inference.adapter_sync import (
    AdapterSync,
    adapter_digest,
    adapter_name,
    adapter_run,
    adapter_version,
)
from inference.config import ServerConfig, WeightSyncConfig
from inference.errors import ConfigError, WeightSyncError
from tests.inference.conftest import eventually
from tests.inference.lora_helpers import edit_config, make_adapter, peft_logprobs, quiet_peft

PROMPT = list(range(3, 40))  # > one prefix-cache block (16), so a cached prefix could be reused


async def call(url: str, body: Any = None, method: str = "POST") -> tuple[int, Any]:
    """Status and body (JSON when it parses, else the text: the LoRA routes answer text)."""
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=body, timeout=aiohttp.ClientTimeout(30)) as r:
            text = await r.text()
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, text


def completion(model: str | None, max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_weight_versions": True,
        "seed": 7,
        **kw,
    }
    if model is not None:
        body["model"] = model
    return body


def sync_config(tmp_path: Path) -> WeightSyncConfig:
    return WeightSyncConfig(root_dir=tmp_path / "w", attempts=2, backoff_s=0.01, timeout_s=30)


async def generate(url: str, model: str | None, **kw: Any) -> dict[str, Any]:
    status, out = await call(url + "/v1/completions", completion(model, **kw))
    assert status == 200, out
    return out


def max_error(out: dict[str, Any], base: Path, adapter: Path | None) -> float:
    choice = out["choices"][0]
    ref = peft_logprobs(base, adapter, PROMPT, choice["token_ids"])
    return float((torch.tensor(choice["logprobs"]["token_logprobs"]) - ref).abs().max())


@pytest.fixture
def adapters(model_dir: Path, tmp_path: Path) -> list[Path]:
    return [make_adapter(model_dir, tmp_path / f"a{i}", seed=i) for i in range(2)]


async def test_adapter_generation_equals_peft_and_base_is_untouched(
    server_factory, model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    server = await server_factory(enable_lora=True, max_loras=2)
    sync = AdapterSync([server.url], sync_config(tmp_path))
    base_before = await generate(server.url, None)  # fills the prefix cache under the base
    await sync.load("run-v1", adapters[0], 1)
    out = await generate(server.url, "run-v1")
    assert out["model"] == "run-v1"  # vLLM names the adapter in the response
    assert max_error(out, model_dir, adapters[0]) < 1e-4  # the base's cached KV was not reused
    assert max_error(out, model_dir, None) > 1e-2  # and the adapter really changes the policy
    # greedy tokens are peft's argmax continuation
    greedy = await generate(server.url, "run-v1", temperature=0.0, max_tokens=6)
    ids = greedy["choices"][0]["token_ids"]
    ref = AdapterReference(model_dir, adapters[0])
    assert ids == ref.greedy(PROMPT, 6)
    base_after = await generate(server.url, None)
    assert base_after["choices"][0]["token_ids"] == base_before["choices"][0]["token_ids"]
    assert max_error(base_after, model_dir, None) < 1e-4
    _, models = await call(server.url + "/v1/models", method="GET")
    cards = {card["id"]: card for card in models["data"]}
    assert cards["run-v1"]["root"] == str(adapters[0])
    assert cards["run-v1"]["parent"] == cards[server.state.model_name]["id"]
    assert cards[server.state.model_name]["parent"] is None


class AdapterReference:
    """peft's greedy continuation, the reference for the server's greedy tokens."""

    def __init__(self, base: Path, adapter: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with quiet_peft():
            self.model = PeftModel.from_pretrained(model, adapter).eval()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt) :]


async def test_two_runs_share_one_server_without_mixing(
    server_factory, model_dir: Path, tmp_path: Path
) -> None:
    """Two runs push their own adapters to one server through their own clients; concurrent
    generations of both runs (batched together) each come from their own adapter."""
    server = await server_factory(enable_lora=True, max_loras=2, batch_window_ms=20)
    runs = {"alpha": 10, "beta": 20}
    clients = {run: AdapterSync([server.url], sync_config(tmp_path / run)) for run in runs}
    paths: dict[str, Path] = {}
    for version in (1, 2):
        for run, seed in runs.items():
            name = adapter_name(run, version)
            paths[name] = make_adapter(model_dir, tmp_path / name, seed=seed + version)
            await clients[run].load(name, paths[name], version)
    await clients["alpha"].unload("alpha-v1")  # alpha moved on; beta still uses both versions
    names = ["alpha-v2", "beta-v1", "beta-v2"] * 2
    outs = await asyncio.gather(*(generate(server.url, n, max_tokens=6) for n in names))
    for name, out in zip(names, outs, strict=True):
        assert out["model"] == name
        assert max_error(out, model_dir, paths[name]) < 1e-4, name
    status, body = await call(server.url + "/v1/completions", completion("alpha-v1"))
    assert status == 404 and body["error"]["param"] == "model"
    _, models = await call(server.url + "/v1/models", method="GET")
    assert {c["id"] for c in models["data"] if c["parent"]} == {"alpha-v2", "beta-v1", "beta-v2"}


async def test_max_loras_one_still_serves_two_adapters(
    server_factory, model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    """With one LoRA slot per batch, requests of a second adapter wait for the slot, then run."""
    server = await server_factory(enable_lora=True, max_loras=1, batch_window_ms=20)
    sync = AdapterSync([server.url], sync_config(tmp_path))
    await sync.load("r-v1", adapters[0], 1)
    await sync.load("r-v2", adapters[1], 2)
    names = ["r-v1", "r-v2", None, "r-v1", "r-v2"]
    outs = await asyncio.gather(*(generate(server.url, n, max_tokens=5) for n in names))
    for name, out in zip(names, outs, strict=True):
        adapter = None if name is None else adapters[int(name[-1]) - 1]
        assert max_error(out, model_dir, adapter) < 1e-4


async def test_unload_lets_running_requests_finish_and_refuses_new_ones(
    server_factory, model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    server = await server_factory(enable_lora=True)
    sync = AdapterSync([server.url], sync_config(tmp_path))
    await sync.load("run-v3", adapters[0], 3)
    running = asyncio.create_task(generate(server.url, "run-v3", max_tokens=400))
    await eventually(lambda: server.state.engine._running != [])
    await sync.unload("run-v3")
    out = await running  # vLLM's unload removes the name only: the request keeps its adapter
    assert len(out["choices"][0]["token_ids"]) == 400
    assert max_error(out, model_dir, adapters[0]) < 1e-4
    status, body = await call(server.url + "/v1/completions", completion("run-v3"))
    assert (status, body["error"]["type"]) == (404, "NotFoundError")
    assert body["error"]["message"] == "The model `run-v3` does not exist."
    await sync.unload("run-v3")  # unloading again is a no-op, not an error


async def test_bad_loads_get_clear_errors_and_the_server_keeps_serving(
    server_factory, model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    server = await server_factory(enable_lora=True, max_lora_rank=8)
    load = server.url + "/v1/load_lora_adapter"
    base = server.state.model_name
    ok = {"lora_name": "x-v1", "lora_path": str(adapters[0])}
    assert await call(load, ok) == (200, "Success: LoRA adapter 'x-v1' added successfully.")
    big = make_adapter(model_dir, tmp_path / "big", seed=3, r=16)
    dora = edit_config(make_adapter(model_dir, tmp_path / "dora", seed=4), use_dora=True)
    no_r = make_adapter(model_dir, tmp_path / "no_r", seed=5)
    config = (no_r / "adapter_config.json").read_text().replace('"r": 4', '"rank": 4')
    (no_r / "adapter_config.json").write_text(config)
    bad_json = make_adapter(model_dir, tmp_path / "bad_json", seed=6)
    (bad_json / "adapter_config.json").write_text("{not json")
    no_weights = make_adapter(model_dir, tmp_path / "no_weights", seed=7)
    (no_weights / "adapter_model.safetensors").unlink()
    torn = make_adapter(model_dir, tmp_path / "torn", seed=7)
    (torn / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    wrong_model = make_adapter(model_dir, tmp_path / "wrong", seed=8, targets=("q_proj",))
    # its tensors renamed to a layer this model does not have
    from safetensors.torch import load_file, save_file

    tensors = load_file(wrong_model / "adapter_model.safetensors")
    renamed = {k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()}
    save_file(renamed, wrong_model / "adapter_model.safetensors")
    cases = [
        ({"lora_name": "x-v1", "lora_path": str(adapters[1])}, 400, "has already been loaded"),
        (
            {"lora_name": "y", "lora_path": str(tmp_path / "absent")},
            404,
            f"Loading lora y failed: No adapter found for {tmp_path / 'absent'}",
        ),
        (
            {"lora_name": "y", "lora_path": str(big)},
            400,
            "LoRA rank 16 is greater than max_lora_rank 8.",
        ),
        ({"lora_name": "y", "lora_path": str(dora)}, 400, "vLLM does not yet support DoRA."),
        ({"lora_name": "y", "lora_path": str(no_r)}, 400, "Missing required configuration"),
        ({"lora_name": "y", "lora_path": str(bad_json)}, 400, "is not valid JSON"),
        ({"lora_name": "y", "lora_path": str(no_weights)}, 400, "has no adapter_model"),
        ({"lora_name": "y", "lora_path": str(torn)}, 400, "is unreadable"),
        ({"lora_name": "y", "lora_path": str(wrong_model)}, 400, "not a linear layer here"),
        ({"lora_name": base, "lora_path": str(adapters[1])}, 400, "conflicts with a served base"),
        ({"lora_name": "", "lora_path": str(adapters[1])}, 400, "Both 'lora_name' and"),
        ({"lora_path": str(adapters[1])}, 400, "lora_name"),
    ]
    for body, status, message in cases:
        got, answer = await call(load, body)
        assert got == status, (body, answer)
        assert message in answer["error"]["message"], answer
        assert answer["error"]["code"] == status
    unload = server.url + "/v1/unload_lora_adapter"
    got, answer = await call(unload, {"lora_name": "nope"})
    assert (got, answer["error"]["message"]) == (404, "The lora adapter 'nope' cannot be found.")
    status, body = await call(server.url + "/v1/completions", completion("nope"))
    assert (status, body["error"]["type"], body["error"]["param"]) == (
        404,
        "NotFoundError",
        "model",
    )
    # the first adapter is intact and still served, in place reload included
    assert max_error(await generate(server.url, "x-v1"), model_dir, adapters[0]) < 1e-4
    inplace = {"lora_name": "x-v1", "lora_path": str(adapters[1]), "load_inplace": True}
    assert (await call(load, inplace))[0] == 200
    assert max_error(await generate(server.url, "x-v1"), model_dir, adapters[1]) < 1e-4


async def test_lora_routes_exist_only_when_enabled(
    server_factory, adapters: list[Path], tmp_path: Path
) -> None:
    server = await server_factory()
    body = {"lora_name": "r-v1", "lora_path": str(adapters[0])}
    assert (await call(server.url + "/v1/load_lora_adapter", body))[0] == 404
    sync = AdapterSync([server.url], sync_config(tmp_path))
    with pytest.raises(WeightSyncError, match="adapter r-v1 not served everywhere") as err:
        await sync.load("r-v1", adapters[0], 1)
    assert "HTTP 404" in err.value.failures[server.url]
    with pytest.raises(ConfigError, match="max_lora_rank must be one of"):
        ServerConfig.load({"model": "m", "max_lora_rank": 4})


async def test_adapter_sync_verifies_every_server_and_names_the_version(
    server_factory, adapters: list[Path], tmp_path: Path
) -> None:
    good = await server_factory(enable_lora=True)
    other = await server_factory(enable_lora=True)
    sync = AdapterSync([good.url, other.url], sync_config(tmp_path))
    # `other` already serves the name from another directory: the push must not be believed there
    status, _ = await call(
        other.url + "/v1/load_lora_adapter", {"lora_name": "r-v4", "lora_path": str(adapters[1])}
    )
    assert status == 200
    with pytest.raises(WeightSyncError) as err:
        await sync.load("r-v4", adapters[0], 4)
    assert set(err.value.failures) == {other.url}
    served = REGISTRY.get_sample_value("farm_weight_sync_served_version", {"server": good.url})
    assert served == 4  # the gauge the stale-weights alert reads, set where it was verified
    assert f"from {adapters[1]}, not {adapters[0]}" in err.value.failures[other.url]
    assert err.value.version == 4
    with pytest.raises(ValueError, match="does not carry version 5"):
        await sync.load("r-v4", adapters[0], 5)
    await sync.close()
    with pytest.raises(RuntimeError, match="closed"):
        await sync.unload("r-v4")


def test_adapter_names_carry_the_version() -> None:
    assert adapter_name("math-run", 12) == "math-run-v12"
    assert adapter_version("math-run-v12") == 12
    assert adapter_version("my-v2-run-v3") == 3
    assert adapter_version("base-model") is None
    named = adapter_name("my-v2-run", 3, "0123456789ab")
    assert named == "my-v2-run-v3-0123456789ab"
    assert adapter_version(named) == 3 and adapter_run(named) == "my-v2-run"
    assert adapter_run("math-run-v12") == "math-run" and adapter_run("base-model") is None
    with pytest.raises(ValueError):
        adapter_name("", 1)
    with pytest.raises(ValueError):
        adapter_name("r", -1)
    with pytest.raises(ValueError, match="hex"):
        adapter_name("r", 1, "XYZ")


def test_the_digest_names_the_adapter_files(model_dir: Path, tmp_path: Path) -> None:
    one = make_adapter(model_dir, tmp_path / "one", seed=1)
    same = shutil.copytree(one, tmp_path / "same")
    other = make_adapter(model_dir, tmp_path / "other", seed=2)
    assert adapter_digest(one) == adapter_digest(same)
    assert adapter_digest(one) != adapter_digest(other)
    edit_config(same, lora_alpha=16)  # the config counts: alpha changes what is served
    assert adapter_digest(one) != adapter_digest(same)
    (one / "adapter_model.safetensors").unlink()
    with pytest.raises(OSError):
        adapter_digest(one)


async def test_openai_routes_serve_adapters_by_model_name(
    server_factory, adapters: list[Path], tmp_path: Path
) -> None:
    server = await server_factory(enable_lora=True)
    await AdapterSync([server.url], sync_config(tmp_path)).load("chat-v1", adapters[0], 1)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1}
    text = {"prompt": "hello", "max_tokens": 4, "seed": 1}
    for route, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        status, out = await call(server.url + route, body | {"model": "chat-v1"})
        assert (status, out["model"]) == (200, "chat-v1"), out
        status, out = await call(server.url + route, body | {"model": "chat-v9"})
        assert (status, out["error"]["type"]) == (404, "NotFoundError"), out
        status, out = await call(server.url + route, body)  # no model: the base
        assert (status, out["model"]) == (200, server.state.model_name), out


@pytest.mark.slow
async def test_the_cli_flags_enable_lora_in_a_real_process(
    process_factory, model_dir: Path, adapters: list[Path], tmp_path: Path
) -> None:
    (server,) = process_factory(extra=["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"])
    sync = AdapterSync([server.url], sync_config(tmp_path))
    await sync.load("cli-v1", adapters[0], 1)
    assert max_error(await generate(server.url, "cli-v1"), model_dir, adapters[0]) < 1e-4
    big = make_adapter(model_dir, tmp_path / "big", seed=9, r=16)
    with pytest.raises(WeightSyncError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        await sync.load("cli-v2", big, 2)
    bad = subprocess.run(
        [sys.executable, "-m", "inference", "--model", str(model_dir), "--max-lora-rank", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "max_lora_rank must be one of" in bad.stderr


async def test_rslora_and_per_module_rank_and_alpha_equal_peft(
    server_factory, model_dir: Path, tmp_path: Path
) -> None:
    """The scaling peft uses per module: alpha/sqrt(r) with rsLoRA, rank_pattern, alpha_pattern."""
    server = await server_factory(enable_lora=True)
    sync = AdapterSync([server.url], sync_config(tmp_path))
    adapter = make_adapter(
        model_dir,
        tmp_path / "patterned",
        seed=11,
        use_rslora=True,
        rank_pattern={"v_proj": 8},
        alpha_pattern={"down_proj": 3},
    )
    await sync.load("pat-v1", adapter, 1)
    assert max_error(await generate(server.url, "pat-v1"), model_dir, adapter) < 1e-4
