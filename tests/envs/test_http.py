"""HTTPEnv against a real aiohttp environment server started by the test.

Faults (5xx, 503, slow replies, garbage bodies, a dead port) are injected by the
server itself: real HTTP, real timeouts, no mocks.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

import envs
from broker.messages import ErrorCategory
from envs.errors import EnvInfraError, EnvSpecError, EnvStateError
from tests.conftest import free_port


class GuessServer:
    """AgentGym-style server for a 'guess the digit' game; faults are queued per path."""

    def __init__(self) -> None:
        self.envs: dict[int, dict[str, Any]] = {}
        self.hits: Counter[str] = Counter()
        self.faults: dict[str, list[str]] = {}
        app = web.Application()
        for path in ("/create", "/reset", "/step", "/close"):
            app.router.add_post(path, self.handle)
        app.router.add_get("/observation", self.handle)
        self.app = app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] += 1
        queued = self.faults.get(path)
        if queued:
            fault = queued.pop(0)
            if fault == "slow":
                await asyncio.sleep(2)
            elif fault == "garbage":
                return web.Response(text="<html>oops")
            elif fault == "404":
                return web.Response(status=404, text="no such env")
            else:
                return web.Response(status=int(fault), text="fault")
        body = dict(request.query) if request.method == "GET" else await request.json()
        return web.json_response(self.answer(path, body))

    def answer(self, path: str, body: dict[str, Any]) -> Any:
        if path == "/create":
            ident = len(self.envs)
            self.envs[ident] = {}
            return {"id": ident}
        state = self.envs[int(body["id"])]
        if path == "/reset":
            state.update(target=body["data_idx"] % 10, tries=0)
            return "ok"
        if path == "/observation":
            return f"guess a digit (try {state['tries']})"
        if path == "/close":
            state["closed"] = True
            return {}
        state["tries"] += 1
        right = body["action"].strip() == str(state["target"])
        return {
            "observation": "right" if right else "wrong",
            "reward": float(right),
            "done": right,
            "truncated": not right and state["tries"] >= 3,
            "info": {"tries": state["tries"]},
        }


@pytest.fixture
async def server() -> AsyncIterator[tuple[GuessServer, str]]:
    game = GuessServer()
    test_server = TestServer(game.app, host="127.0.0.1")
    await test_server.start_server()
    yield game, str(test_server.make_url("")).rstrip("/")
    await test_server.close()


def _env(url: str, **extra: Any) -> Any:
    kwargs = {"url": url, "timeout_s": 0.5, "backoff_s": 0.01, **extra}
    import json

    return envs.make("http@" + json.dumps(kwargs))


async def test_episode_over_http(server: tuple[GuessServer, str]) -> None:
    game, url = server
    env = _env(url)
    obs, info = await envs.areset(env, seed=13)
    assert obs == "guess a digit (try 0)" and info["env_id"] == 0
    assert await envs.astep(env, "2") == ("wrong", 0.0, False, False, {"tries": 1})
    assert await envs.astep(env, "3") == ("right", 1.0, True, False, {"tries": 2})
    await envs.areset(env, seed=4)  # same remote env reused
    assert game.hits["/create"] == 1
    for _ in range(2):
        await envs.astep(env, "0")
    assert (await envs.astep(env, "0"))[2:4] == (False, True)
    await envs.aclose(env)
    assert game.envs[0]["closed"]
    with pytest.raises(EnvStateError):
        await envs.areset(env)


async def test_transient_errors_retried(server: tuple[GuessServer, str]) -> None:
    game, url = server
    game.faults = {"/create": ["500", "slow"], "/reset": ["502"], "/step": ["503"]}
    env = _env(url)
    try:
        obs, _ = await envs.areset(env, seed=1)
        assert obs.startswith("guess") and game.hits["/create"] == 3
        assert (await envs.astep(env, "1"))[1] == 1.0
        assert game.hits["/step"] == 2  # 503 means "not processed": retried once
    finally:
        await envs.aclose(env)


async def test_non_idempotent_step_not_retried_after_500(server: tuple[GuessServer, str]) -> None:
    game, url = server
    env = _env(url)
    await envs.areset(env, seed=1)
    game.faults = {"/step": ["500"]}
    with pytest.raises(EnvInfraError) as err:
        await envs.astep(env, "1")
    assert err.value.category == ErrorCategory.ENV and game.hits["/step"] == 1
    await envs.aclose(env)


@pytest.mark.parametrize(
    ("faults", "fragment"),
    [
        ({"/reset": ["500"] * 5}, "after 3 attempt"),
        ({"/reset": ["garbage"]}, "not JSON"),
        ({"/reset": ["404"]}, "HTTP 404"),
        ({"/step": ["slow"]}, "TimeoutError"),
    ],
)
async def test_persistent_faults_become_infra_errors(
    server: tuple[GuessServer, str], faults: dict, fragment: str
) -> None:
    game, url = server
    env = _env(url, retries=2)
    try:
        if "/step" in faults:
            await envs.areset(env, seed=0)
        game.faults = faults
        with pytest.raises(EnvInfraError, match=fragment):
            await envs.areset(env, seed=0) if "/reset" in faults else await envs.astep(env, "0")
    finally:
        await envs.aclose(env)


async def test_dead_server_and_bad_spec() -> None:
    env = _env(f"http://127.0.0.1:{free_port()}", retries=1)
    with pytest.raises(EnvInfraError, match="cannot connect"):
        await envs.areset(env)
    await envs.aclose(env)
    with pytest.raises(EnvSpecError, match="bad kwargs for 'http'"):
        envs.make('http@{"url": "http://x", "colour": 1}')
    with pytest.raises(EnvSpecError):
        envs.make('http@{"url": "http://x", "timeout_s": -1}')
