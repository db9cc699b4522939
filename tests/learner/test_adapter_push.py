"""The LoRA push of the learner (`learner.adapter_push`) against the CPU policy server: a
version is a content-named adapter, so a restarted learner's re-trained version is served with
its own tensors; what stays loaded (this push and the one before; a restarted learner's first
push unloads nothing) and what stays on disk (until no server has listed it for keep_s)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import torch

from inference.adapter_sync import adapter_run, adapter_version
from inference.client import ClientConfig, GenerationClient, SamplingParams, ServedAdapter
from inference.config import ServerConfig, WeightSyncConfig
from inference.server import PolicyServer
from learner.adapter_push import AdapterPusher
from tests.inference.lora_helpers import AdapterSource, make_adapter, peft_logprobs

PROMPT = [1, 5, 9, 42, 7, 3]


class Clock:
    """The pusher's clock, moved by the test (keep_s is minutes in a real run)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def loaded(url: str, run: str) -> set[str]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as answer:
        cards = (await answer.json())["data"]
    return {c["id"] for c in cards if adapter_run(c["id"]) == run}


async def served_error(url: str, name: str, version: int, model: Path, adapter: Path) -> float:
    """Largest difference between the server's logprobs under `name` and peft's under `adapter`."""
    async with GenerationClient([url], ClientConfig(retry_budget_s=30)) as client:
        params = SamplingParams(max_tokens=6, seed=3)
        gen = await client.generate(PROMPT, params, adapter=ServedAdapter(name, version))
    want = peft_logprobs(model, adapter, PROMPT, gen.token_ids)
    return float((torch.tensor(gen.logprobs) - want).abs().max())


async def test_a_restarted_learner_serves_its_own_version_and_cleans_up(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapters = {v: make_adapter(tiny_model_dir, tmp_path / f"a{v}", seed=v) for v in range(1, 6)}
    root = tmp_path / "weights"
    clock = Clock()
    config = ServerConfig(model=tiny_model_dir, port=0, enable_lora=True, max_loras=2)
    async with PolicyServer(config) as server:

        def pusher() -> AdapterPusher:
            sync = WeightSyncConfig(root_dir=root, attempts=1)
            return AdapterPusher([server.url], sync, "run", keep_s=100.0, clock=clock)

        first, names = pusher(), {}
        for version in (1, 2, 3):
            names[version], path, _ = await first.push(AdapterSource(adapters[version]), version)
            assert path == root / names[version] and adapter_version(names[version]) == version
            clock.now += 10
        assert await loaded(server.url, "run") == {names[2], names[3]}
        assert (root / names[1]).is_dir()  # unloaded 10 s ago: a queued request may read it
        clock.now += 100
        names[4], _, _ = await first.push(AdapterSource(adapters[4]), 4)
        assert not (root / names[1]).exists() and (root / names[2]).is_dir()
        # the learner dies (mid-export of version 5); the next one resumes from step 3 and
        # trains version 4 again
        (root / ".tmp-run-v5-999999").mkdir()
        second = pusher()
        again, path, _ = await second.push(AdapterSource(adapters[5]), 4)
        assert again != names[4] and adapter_version(again) == 4
        assert await served_error(server.url, again, 4, tiny_model_dir, adapters[5]) < 1e-4
        assert await served_error(server.url, names[4], 4, tiny_model_dir, adapters[4]) < 1e-4
        # its first push unloads nothing (workers still use the old learner's version 4)
        assert await loaded(server.url, "run") == {names[3], names[4], again}
        retried, same, _ = await second.push(AdapterSource(adapters[5]), 4)  # the same bytes
        assert (retried, same) == (again, path)
        clock.now += 1
        newest, _, _ = await second.push(AdapterSource(adapters[1]), 5)
        assert await loaded(server.url, "run") == {again, newest}
        left = {p.name for p in root.iterdir()}
        assert {names[2], names[3], names[4], again, newest} <= left  # all within keep_s
        clock.now += 100
        await second.push(AdapterSource(adapters[2]), 6)
        assert {p.name for p in root.iterdir()} == {again, newest, *await loaded(server.url, "run")}
        await first.close()
        await second.close()
