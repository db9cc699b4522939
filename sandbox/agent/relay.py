"""The bridge relay: a program in a session reaches the host's socket over its own loopback.

Run inside a session as one call, ``python3 -I -c <this file's source>``, with a JSON
object on stdin: ``{"argv": [...], "env": {...}}``. It listens on an ephemeral port of
127.0.0.1 (the session's own loopback: no neighbour can connect to it), starts ``argv``
with ``env`` and ``OPENAI_BASE_URL=http://127.0.0.1:<port>/v1``, and copies every
connection to the host's bridge socket, which the session reaches only through the
descriptor each call inherits (``/proc/self/fd/5``: `.call.BRIDGE_FD`). It exits with the
program's exit status once the program ends; the call's timeout kills both. Stdlib only,
one thread (threads count against the session's process limit).
"""

import json
import os
import selectors
import socket
import subprocess
import sys

BRIDGE = "/proc/self/fd/5"
CHUNK = 65536


def _join(sel: selectors.BaseSelector, peers: dict, listener: socket.socket) -> None:
    conn, _ = listener.accept()
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(BRIDGE)
    except OSError as exc:
        print(f"relay: the bridge is unreachable: {exc}", file=sys.stderr, flush=True)
        conn.close()
        upstream.close()
        return
    peers[conn], peers[upstream] = upstream, conn
    sel.register(conn, selectors.EVENT_READ)
    sel.register(upstream, selectors.EVENT_READ)


def _copy(sel: selectors.BaseSelector, peers: dict, sock: socket.socket) -> None:
    other = peers[sock]
    try:
        data = sock.recv(CHUNK)
        if data:
            other.sendall(data)  # HTTP never has both sides writing at once
    except OSError:
        data = b""
    if not data:  # either side done: the exchange over that connection is over
        for s in (sock, other):
            sel.unregister(s)
            peers.pop(s)
            s.close()


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    env = {**os.environ, **spec.get("env", {})}
    env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{port}/v1"
    try:
        child = subprocess.Popen(spec["argv"], env=env, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"relay: cannot start {spec['argv'][:1]}: {exc}", file=sys.stderr)
        return 127
    exited = os.pidfd_open(child.pid)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(exited, selectors.EVENT_READ)
    peers: dict = {}
    while True:
        for key, _ in sel.select():
            if key.fileobj == exited:
                code = child.wait()
                return code if code >= 0 else 128 - code
            if key.fileobj is listener:
                _join(sel, peers, listener)
            elif key.fileobj in peers:
                _copy(sel, peers, key.fileobj)


if __name__ == "__main__":
    sys.exit(main())
