"""A lean keep-alive HTTP/1.1 client for the generation hot path.

A worker sends one small JSON request per environment step, thousands at a time. aiohttp
spends about 300 µs of CPU on each (URL objects, header multidicts, tracing hooks, stream
readers); this client writes a pre-built request head and parses the reply with httptools
(llhttp, the parser of uvicorn and Node.js), which costs a fraction of that.

- Connections are pooled per origin and reused; at most `limit` are open at once across
  all origins, and a request waits for a free one beyond that.
- A reused connection that the server closed while it sat idle (keep-alive timeouts race
  with new requests) is retried once on a fresh connection, if no byte of a reply came.
- Cancelling a request, or its timeout, closes its connection: the server sees the
  client go away (vLLM and the CPU server then abort the sequence).
- Replies must carry Content-Length or chunked encoding, as every JSON API server sends.
- A request with a `sink` hands a 200 reply's body to it piece by piece as it arrives (a
  stream of server-sent events), instead of gathering it; other statuses are gathered, so
  their error body reads as usual.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

__all__ = ["HttpClient", "HttpConnectionError", "Response", "Sink"]


Sink = Callable[[bytes], None]  # takes a streamed body's pieces, inside the protocol callback


class HttpConnectionError(ConnectionError):
    """The connection failed, or the reply was not valid HTTP."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; one request at a time."""

    def __init__(self, pool: HttpClient, origin: str) -> None:
        self.pool, self.origin = pool, origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.chunks: list[bytes] = []
        self.sink: Sink | None = None  # the current request's body consumer, if it streams
        self.replied = False  # a byte of the current reply arrived
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.replied = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpConnectionError(f"invalid HTTP reply: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(HttpConnectionError(f"server closed the connection ({exc or 'EOF'})"))
        self.pool._forget(self)

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        if self.sink is not None and self.parser.get_status_code() == 200:
            self.sink(body)
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        body, self.chunks = b"".join(self.chunks), []
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(
                (self.parser.get_status_code(), body, self.parser.should_keep_alive())
            )

    # used by the pool
    def send(self, data: bytes, sink: Sink | None) -> asyncio.Future[tuple[int, bytes, bool]]:
        assert self.transport is not None
        self.sink = sink
        self.waiter = asyncio.get_running_loop().create_future()
        self.replied = False
        self.transport.write(data)
        return self.waiter

    def expire(self) -> None:
        """The request's deadline passed: fail it, and drop the connection."""
        self._fail(TimeoutError())
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.pool._forget(self)

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class HttpClient:
    """Pooled keep-alive connections; `await close()` when done."""

    def __init__(
        self, *, limit: int, connect_timeout_s: float, headers: dict[str, str] | None = None
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit, self.connect_timeout_s = limit, connect_timeout_s
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: dict[str, list[_Connection]] = collections.defaultdict(list)
        self._live: set[_Connection] = set()  # open or opening
        self._opening = 0
        # Requests waiting for a connection: (origin, future of a connection, or None
        # for a slot reserved to open one).
        self._waiters: collections.deque[tuple[str, asyncio.Future[_Connection | None]]] = (
            collections.deque()
        )
        self._dispatching = False
        self._targets: dict[tuple[str, str], tuple[str, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return len(self._live) + self._opening

    async def request(
        self, method: str, url: str, body: bytes | None, timeout_s: float, sink: Sink | None = None
    ) -> Response:
        """Send one request; raises HttpConnectionError, TimeoutError or OSError. With a `sink`,
        a 200 reply's body goes to it as it arrives (the Response's body is then empty); it
        is called from the connection's protocol callback, so it must only hand data on."""
        origin, head = self._target(method, url)
        data = head + b"%d\r\n\r\n" % len(body or b"") + (body or b"")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for attempt in (0, 1):
            # Idle connections go to queued requests first (FIFO), never past them.
            conn = None if self._waiters else self._pop_idle(origin)
            reused = conn is not None
            if conn is None:  # the slow path: wait for a connection or a free slot
                async with asyncio.timeout_at(deadline):
                    conn, reused = await self._acquire(origin)
            # A bare timer, not asyncio.timeout: this runs once per env step.
            timer = loop.call_at(deadline, conn.expire)
            try:
                status, reply, keep = await conn.send(data, sink)
            except HttpConnectionError:
                conn.close()
                if reused and not conn.replied and attempt == 0:
                    continue  # a stale keep-alive connection: the request never arrived
                raise
            except BaseException:
                conn.close()  # cancelled or timed out: closing tells the server to stop
                raise
            finally:
                timer.cancel()
            self._release(conn, keep)
            return Response(status, reply)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._live):
            conn.close()
        while self._waiters:
            _, waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(HttpConnectionError("client closed"))

    # --- pool --------------------------------------------------------------------------------
    def _pop_idle(self, origin: str) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _acquire(self, origin: str) -> tuple[_Connection, bool]:
        """A new connection to `origin`, or one handed over in arrival order (called once
        `request` found no idle connection it may take)."""
        if self._closed:
            raise HttpConnectionError("client closed")
        if not self._waiters and (self.open_connections < self.limit or self._evict_idle()):
            return await self._open(origin), False
        waiter: asyncio.Future[_Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append((origin, waiter))
        self._dispatch()
        try:
            conn = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                granted = waiter.result()  # granted, then cancelled: pass it on
                if granted is None:
                    self._opening -= 1
                    self._dispatch()
                else:
                    self._release(granted, True)
            raise
        if conn is None:  # a free slot, reserved for this request by _dispatch
            return await self._open(origin, reserved=True), False
        return conn, True

    def _dispatch(self) -> None:
        """Serve queued requests, oldest first: an idle connection to the same server, or
        a free slot (made by closing an idle connection to another server if need be)."""
        if self._dispatching:
            return  # re-entered through _evict_idle -> close -> _forget
        self._dispatching = True
        try:
            self._serve_waiters()
        finally:
            self._dispatching = False

    def _serve_waiters(self) -> None:
        waiters = self._waiters
        while waiters:
            origin, waiter = waiters[0]
            if waiter.done():  # cancelled or timed out while queued
                waiters.popleft()
                continue
            conn = self._pop_idle(origin)
            if conn is not None:
                waiters.popleft()
                waiter.set_result(conn)
            elif self.open_connections < self.limit or self._evict_idle():
                waiters.popleft()
                self._opening += 1  # reserved: released by _open
                waiter.set_result(None)
            else:
                return

    async def _open(self, origin: str, reserved: bool = False) -> _Connection:
        scheme, _, hostport = origin.partition("://")
        host, _, port = hostport.rpartition(":")
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        if not reserved:
            self._opening += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: _Connection(self, origin), host.strip("[]"), int(port), ssl=context
                )
        except BaseException:
            self._opening -= 1
            self._dispatch()  # the slot is free again
            raise
        self._opening -= 1
        self._live.add(conn)
        if self._closed:
            conn.close()
            raise HttpConnectionError("client closed")
        return conn

    def _release(self, conn: _Connection, keep_alive: bool) -> None:
        if keep_alive and not conn.closed and not self._closed:
            self._idle[conn.origin].append(conn)
            if self._waiters:
                self._dispatch()
        else:
            conn.close()

    def _forget(self, conn: _Connection) -> None:
        """`conn` is closed: drop it, and give its slot to a queued request."""
        if conn in self._live:
            self._live.discard(conn)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            if self._waiters:
                self._dispatch()

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection, if any (its slot frees at once)."""
        for idle in self._idle.values():
            while idle:
                conn = idle.pop(0)
                if not conn.closed:
                    conn.close()
                    return True
        return False

    def _target(self, method: str, url: str) -> tuple[str, bytes]:
        """(origin, request head up to the Content-Length value), cached per method and URL."""
        key = (method, url)
        target = self._targets.get(key)
        if target is None:
            origin, path = _split(url)
            host = origin.partition("://")[2]
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{self._extra}"
                "Content-Type: application/json\r\nContent-Length: "
            ).encode("latin-1")
            target = self._targets[key] = (origin, head)
        return target


def _split(url: str) -> tuple[str, str]:
    """'http://h:p/path?q' -> ('http://h:p', '/path?q'), with the default port filled in."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return f"{parts.scheme}://{host}:{port}", path
