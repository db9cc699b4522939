"""The lean HTTP client against real sockets: reuse, stale connections, framing, limits.

Servers here are real asyncio TCP servers that answer with hand-written bytes, so each
misbehaviour (a close mid-reply, garbage, chunked bodies) really happens on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from inference.http import HttpClient, HttpConnectionError

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """Counts connections and requests; `handler(reader, writer, n)` answers request n of a connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests = 0
        self.closed_by_client = asyncio.Event()
        self.received = asyncio.Event()
        self.bodies: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.bodies.append(await reader.readexactly(length))
                self.requests += 1
                self.received.set()
                n += 1
                await self.handler(reader, writer, n)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[Server, str]]:
    server = Server(handler)
    tcp = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        tcp.close()


async def reply_ok(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
    w.write(OK)
    await w.drain()


@pytest.fixture
async def client() -> AsyncIterator[HttpClient]:
    http = HttpClient(limit=4, connect_timeout_s=2)
    yield http
    await http.close()


async def test_sequential_requests_reuse_one_connection(client: HttpClient) -> None:
    async with serving(reply_ok) as (server, url):
        for i in range(5):
            resp = await client.request("POST", url + "/v1/completions", b'{"i": %d}' % i, 5)
            assert (resp.status, resp.body) == (200, b"{}")
    assert server.connections == 1
    assert server.bodies == [b'{"i": %d}' % i for i in range(5)]


async def test_a_stale_keep_alive_connection_is_retried_on_a_fresh_one(client: HttpClient) -> None:
    async def close_on_reuse(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            w.write(OK)
            await w.drain()
        else:
            w.close()  # the server's keep-alive timer fired as the request arrived

    async with serving(close_on_reuse) as (server, url):
        assert (await client.request("POST", url + "/x", b"1", 5)).status == 200
        assert (await client.request("POST", url + "/x", b"2", 5)).status == 200
    assert server.connections == 2
    assert server.bodies == [b"1", b"2", b"2"]


async def test_a_fresh_connection_closed_without_a_reply_is_an_error(client: HttpClient) -> None:
    async def hang_up(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.close()

    async with serving(hang_up) as (server, url):
        with pytest.raises(HttpConnectionError, match="closed the connection"):
            await client.request("POST", url + "/x", b"1", 5)
    assert server.requests == 1  # not retried: it may have reached the application


async def test_connection_close_replies_are_not_reused(client: HttpClient) -> None:
    reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"

    async def close_after(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(reply)
        await w.drain()

    async with serving(close_after) as (server, url):
        for _ in range(3):
            assert (await client.request("GET", url + "/health", None, 5)).body == b"ok"
    assert server.connections == 3


async def test_chunked_replies_are_reassembled(client: HttpClient) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )

    async def send_chunked(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(chunked[:40])
        await w.drain()
        await asyncio.sleep(0.01)  # the reply arrives in two reads
        w.write(chunked[40:])
        await w.drain()

    async with serving(send_chunked) as (server, url):
        assert (await client.request("POST", url + "/x", b"", 5)).body == b"hello world"
        assert (await client.request("POST", url + "/x", b"", 5)).body == b"hello world"
    assert server.connections == 1


async def test_a_sink_gets_a_streamed_body_as_it_arrives_and_errors_stay_whole(
    client: HttpClient,
) -> None:
    """A 200 reply's pieces reach the sink while the reply is still open (the second piece is
    only sent once the test saw the first); an error reply is gathered as usual."""
    first_seen = asyncio.Event()

    async def stream(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        if n == 2:
            w.write(b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy")
            return
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await asyncio.wait_for(first_seen.wait(), 5)
        w.write(b"6\r\n world\r\n0\r\n\r\n")

    pieces: list[bytes] = []

    def sink(piece: bytes) -> None:
        pieces.append(piece)
        first_seen.set()

    async with serving(stream) as (server, url):
        reply = await client.request("POST", url + "/x", b"", 5, sink=sink)
        error = await client.request("POST", url + "/x", b"", 5, sink=pieces.append)
        plain = await client.request("POST", url + "/x", b"", 5)
    assert (reply.status, reply.body, pieces) == (200, b"", [b"hello", b" world"])
    assert (error.status, error.body) == (503, b"busy")
    assert plain.body == b"hello world"  # the next request on the connection gathers again
    assert server.connections == 1


async def test_garbage_reply_is_a_connection_error(client: HttpClient) -> None:
    async def garbage(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await w.drain()

    async with serving(garbage) as (_, url):
        with pytest.raises(HttpConnectionError, match="invalid HTTP reply"):
            await client.request("POST", url + "/x", b"", 5)


async def test_timeout_closes_the_connection(client: HttpClient) -> None:
    async def never(r: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await r.read()  # no reply; returns when the client hangs up

    async with serving(never) as (server, url):
        with pytest.raises(TimeoutError):
            await client.request("POST", url + "/x", b"", 0.2)
        await asyncio.wait_for(server.closed_by_client.wait(), 5)
    assert client.open_connections == 0


async def test_cancelling_a_request_closes_its_connection(client: HttpClient) -> None:
    async def never(r: asyncio.StreamReader, _w: asyncio.StreamWriter, _n: int) -> None:
        await r.read()  # no reply; returns when the client hangs up

    async with serving(never) as (server, url):
        call = asyncio.create_task(client.request("POST", url + "/x", b"", 30))
        await asyncio.wait_for(server.received.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(server.closed_by_client.wait(), 5)


async def test_limit_holds_across_origins_and_idle_connections_make_room() -> None:
    http = HttpClient(limit=2, connect_timeout_s=2)
    release = asyncio.Event()

    async def slow(_r: asyncio.StreamReader, w: asyncio.StreamWriter, _n: int) -> None:
        await release.wait()
        w.write(OK)
        await w.drain()

    try:
        async with serving(slow) as (a, url_a), serving(reply_ok) as (b, url_b):
            calls = [
                asyncio.create_task(http.request("POST", url_a + "/x", b"", 10)) for _ in range(3)
            ]
            await asyncio.sleep(0.2)
            assert a.connections == 2 and http.open_connections == 2  # the third waits
            release.set()
            assert [r.status for r in await asyncio.gather(*calls)] == [200, 200, 200]
            assert a.connections == 2
            # Both slots hold idle connections to A: a request to B evicts one of them.
            assert (await http.request("POST", url_b + "/x", b"", 5)).status == 200
            assert http.open_connections == 2 and b.connections == 1
    finally:
        await http.close()


async def test_queued_requests_are_served_before_newer_ones() -> None:
    """A caller that sends again as soon as its reply comes back does not jump the queue."""
    http = HttpClient(limit=1, connect_timeout_s=2)
    try:
        async with serving(reply_ok) as (server, url):

            async def eager() -> None:
                for i in range(3):
                    await http.request("POST", url + "/x", b"eager%d" % i, 5)

            async def once(i: int) -> None:
                await http.request("POST", url + "/x", b"queued%d" % i, 5)

            first = asyncio.create_task(eager())
            await asyncio.sleep(0)  # eager0 takes the only connection
            await asyncio.gather(first, *(once(i) for i in range(3)))
        assert server.bodies == [
            b"eager0",
            b"queued0",
            b"queued1",
            b"queued2",
            b"eager1",
            b"eager2",
        ]
    finally:
        await http.close()


async def test_unreachable_server_is_an_os_error(client: HttpClient) -> None:
    async with serving(reply_ok) as (_, url):
        pass  # the port is closed again
    with pytest.raises(OSError):
        await client.request("POST", url + "/x", b"", 5)
    assert client.open_connections == 0


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="not an http"):
        asyncio.run(HttpClient(limit=1, connect_timeout_s=1).request("GET", "ftp://h/x", None, 1))
