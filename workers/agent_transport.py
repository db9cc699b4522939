"""The agent endpoint without HTTP, for agents that run in the worker's own process.

An `agent` function gets an `OpenAIConfig` whose `client_kwargs()` carry an
`httpx.AsyncClient` over `EndpointTransport`: the OpenAI SDK (or any httpx client) builds its
request as usual, and the transport hands the request's method, path, `Authorization` header
and body straight to `AgentEndpoint.answer`, the function the HTTP routes call too. There is
no socket, no HTTP parsing on either side and no second JSON round trip through aiohttp, so
the agent's code is unchanged and what is recorded is what the HTTP path records. The host
and port of the URL are not looked at (the endpoint's `base_url` still names the TCP port, for
agents that use another client). A streamed answer is handed over frame by frame as the
endpoint yields it. httpx comes with the `openai` SDK (the `agent` extra).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import httpx

from inference.openai.reply import JSON_TYPE
from inference.openai.sse import SSE_HEADERS
from workers.agent_endpoint import AgentEndpoint

_JSON = JSON_TYPE.encode()


class _Frames(httpx.AsyncByteStream):
    """A streamed reply's frames as httpx reads a response body."""

    def __init__(self, frames: AsyncGenerator[bytes, None]) -> None:
        self._frames = frames

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for frame in self._frames:
            yield frame

    async def aclose(self) -> None:  # the client stopped reading: end the generator
        await self._frames.aclose()


class EndpointTransport(httpx.AsyncBaseTransport):
    """An httpx transport that answers every request with `endpoint`, in this process."""

    def __init__(self, endpoint: AgentEndpoint) -> None:
        self._endpoint = endpoint

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        auth = request.headers.get("authorization", "")
        reply = await self._endpoint.answer(request.method, request.url.path, auth, raw)
        if reply.events is None:  # the body as a stream: `content=` would decode it here too
            length = str(len(reply.body)).encode()
            headers = [(b"Content-Type", _JSON), (b"Content-Length", length)]
            return httpx.Response(
                reply.status, headers=headers, stream=httpx.ByteStream(reply.body)
            )
        return httpx.Response(reply.status, headers=SSE_HEADERS, stream=_Frames(reply.events))


def in_process_client(endpoint: AgentEndpoint) -> httpx.AsyncClient:
    """A fresh client over the endpoint (the SDK closes the client it is given when it closes;
    closing one does not touch the endpoint)."""
    return httpx.AsyncClient(transport=EndpointTransport(endpoint))
