"""The agent's control loop: accepts connections, opens and closes sessions.

One agent runs per sandbox, ideally as PID 1 so the code it runs cannot signal it. It
listens on ``<socket-dir>/agent.sock`` for ``ping``, ``open`` and ``close``; ``open``
forks a session process (see `.slots` and `.session`) with its own socket
``s-<session>.sock``, which the host then talks to directly. An ``open`` may name a
``bridge``: a socket the host listens on in the socket dir, which the session's processes
reach through an inherited descriptor (`.call.BRIDGE_FD`) and nothing else can. No session can reach
either kind of socket (another uid, or its own mount namespace hides them), so every
frame here comes from the host, and ``open`` fixes the most a session's calls may use.

The loop never dies of what a session did: a refused fork or a failed wipe is an error
reply (the host then recycles the sandbox), and a closed session leaves nothing behind.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import selectors
import signal
import socket
import stat

from . import slots
from .call import LIMIT_KEYS, set_bridge
from .procs import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    PR_SET_PDEATHSIG,
    _prctl,
    _signal,
    kill_descendants,
    kill_uid,
    reap,
)
from .session import _serve_session
from .wire import HEADER, MAX_FRAME, FrameError, _error, decode_body, encode_frame

SESSION_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
BRIDGE_RE = re.compile(r"^b-[A-Za-z0-9_-]{1,40}\.sock$")


def _bind(path: str, group: int | None) -> socket.socket:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # owner and group only: the host's pool is one of them
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
    sock.listen(16)
    return sock


class Agent:
    """The control loop: accepts any number of connections, forks session processes.

    With ``session_uids`` (first uid, count) and root inside the sandbox, session slot
    ``i`` runs as uid ``first + i`` in ``<work-dir>/<i>``, with no capabilities and
    no-new-privileges; the agent keeps only what it needs to create and end sessions.
    Without them every session runs as the agent's own uid (one session per jail).
    """

    def __init__(
        self,
        socket_dir: str,
        tenancy: slots.Tenancy,
        lifeline: int = -1,
        session_uids: tuple[int, int] | None = None,
        host_gid: int = 0,
    ) -> None:
        self.socket_dir, self.tenancy, self.lifeline = socket_dir, tenancy, lifeline
        self.work_dir = tenancy.work_dir
        self.sessions: dict[str, int] = {}
        self.slots: dict[str, int] = {}  # session id -> slot, kept across a reopen
        first, count = session_uids or (0, 0)
        if session_uids and os.geteuid() != 0:
            # asked to isolate sessions and unable to: never fall back to a shared uid
            raise PermissionError("--session-uids needs root in the sandbox to switch uids")
        self.group: int | None = None
        self.free = list(range(count)) if session_uids else []
        if session_uids:
            tenancy.first_uid = first
            # only the agent and the host's group may enter: no session reaches a socket
            os.chown(socket_dir, 0, host_gid)
            os.chmod(socket_dir, 0o770)
            self.group = host_gid
        # a session of the same uid (bwrap) must not read our memory or descriptors
        _prctl(PR_SET_DUMPABLE, 0)
        self.sel = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytearray] = {}
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(self.wakeup_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wakeup_w)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.listener = _bind(os.path.join(socket_dir, "agent.sock"), self.group)
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(self.wakeup_r, selectors.EVENT_READ)
        if lifeline >= 0:
            self.sel.register(lifeline, selectors.EVENT_READ)

    def serve_forever(self) -> None:
        gc.freeze()  # keep the session forks' copy-on-write pages shared
        while True:
            for key, _ in self.sel.select():
                try:
                    if key.fileobj is self.listener:
                        conn, _ = self.listener.accept()
                        self.buffers[conn] = bytearray()
                        self.sel.register(conn, selectors.EVENT_READ)
                    elif key.fileobj == self.wakeup_r:
                        self._on_child_exit()
                    elif key.fileobj == self.lifeline:
                        return  # the pool died: as PID 1 our exit ends the whole sandbox
                    else:
                        self._on_readable(key.fileobj)
                except OSError:
                    continue  # out of descriptors or processes: the next event may do

    def _on_child_exit(self) -> None:
        try:
            while os.read(self.wakeup_r, 4096):
                pass
        except BlockingIOError:
            pass
        statuses: dict[int, int] = {}
        reap(statuses)
        live = set(self.sessions.values())
        if any(pid in live for pid in statuses):
            self.sessions = {s: p for s, p in self.sessions.items() if p not in statuses}
        if statuses:
            # orphans of a dead session are now ours: anything not a session goes
            kill_descendants(os.getpid(), keep=frozenset(self.sessions.values()))
            reap()

    def _on_readable(self, conn: socket.socket) -> None:
        buf = self.buffers[conn]
        try:
            chunk = conn.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(conn)
            return
        buf += chunk
        while len(buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(buf)
            if length > MAX_FRAME:
                self._reply(conn, _error(f"frame of {length} bytes exceeds {MAX_FRAME}"))
                self._drop(conn)
                return
            if len(buf) < HEADER.size + length:
                return
            body = bytes(buf[HEADER.size : HEADER.size + length])
            del buf[: HEADER.size + length]
            try:
                reply = self.handle(decode_body(body))
            except FrameError as exc:
                reply = _error(str(exc))
            except OSError as exc:  # a refused fork, a full disk: the sandbox, not us
                reply = _error(f"the sandbox could not do it: {exc!r}")
            self._reply(conn, reply)

    def _reply(self, conn: socket.socket, obj: dict) -> None:
        try:
            conn.sendall(encode_frame(obj))
        except OSError:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if conn in self.buffers:
            del self.buffers[conn]
            self.sel.unregister(conn)
            conn.close()

    def handle(self, req: dict) -> dict:
        op, sid = req.get("op"), req.get("session")
        if op == "ping":
            problems = self.tenancy.problems
            return {"ok": True, "pid": os.getpid(), "sessions": len(self.sessions)} | (
                {"missing": problems} if problems else {}
            )
        if op not in ("open", "close"):
            return _error(f"unknown op {op!r}")
        if not isinstance(sid, str) or not SESSION_RE.match(sid):
            return _error("'session' must match [A-Za-z0-9_-]{1,40}")
        if op == "close":
            return self._close(sid)
        limits = req.get("limits")
        if not isinstance(limits, dict) or not all(
            isinstance(limits.get(k), int) and limits[k] > 0 for k in LIMIT_KEYS
        ):
            return _error(f"'limits' must give a positive int for each of {LIMIT_KEYS}")
        self._stop_session(sid)
        fresh = self.tenancy.first_uid is not None and sid not in self.slots
        if fresh:
            if not self.free:
                return _error("no free session slot in this sandbox")
            self.slots[sid] = self.free.pop()
        bridge = req.get("bridge")
        if bridge is not None and not (isinstance(bridge, str) and BRIDGE_RE.match(bridge)):
            return _error("'bridge' must name a socket b-<name>.sock in the socket dir")
        reply: dict = {}
        try:
            reply = self._open(sid, {k: limits[k] for k in LIMIT_KEYS}, bridge)
        finally:
            if fresh and not reply.get("ok"):  # never served: the slot is as it was
                self.free.append(self.slots.pop(sid))
        return reply

    def _close(self, sid: str) -> dict:
        """End the session's processes (all of its uid, or all but the other sessions'),
        then delete its files; a slot whose files survived is never handed out again."""
        self._stop_session(sid)
        slot = self.slots.pop(sid, None)
        uid = self.tenancy.uid(slot)
        if uid is not None:
            kill_uid(uid)  # whatever tree its processes escaped to
        else:
            kill_descendants(os.getpid(), keep=frozenset(self.sessions.values()))
        reap()
        if not slots.wipe(self.tenancy, slot, self._slot_dir_of(sid, slot), slot is None):
            return _error("the closed session's files could not be removed")
        if slot is not None:
            self.free.append(slot)
        return {"ok": True}

    def _slot_dir_of(self, sid: str, slot: int | None) -> str:
        return os.path.join(self.work_dir, str(sid if slot is None else slot))

    def _stop_session(self, sid: str) -> None:
        pid = self.sessions.pop(sid, None)
        if pid is not None:
            kill_descendants(pid)
            _signal(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            kill_descendants(os.getpid(), keep=frozenset(self.sessions.values()))
            reap()

    def _bridge_fd(self, name: str | None) -> int:
        """A path-only descriptor of the host's socket ``name`` (-1 for none). The session
        connects through it (``/proc/self/fd/N``), so neither the socket dir, which its
        uid cannot enter, nor any path to the socket is ever visible to it."""
        if name is None:
            return -1
        fd = os.open(os.path.join(self.socket_dir, name), os.O_PATH | os.O_NOFOLLOW)
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"bridge {name} is not a socket")
        return fd

    def _open(self, sid: str, ceiling: dict, bridge: str | None = None) -> dict:
        slot = self.slots.get(sid)
        slot_dir = self._slot_dir_of(sid, slot)
        uid = self.tenancy.uid(slot)
        if uid is None:
            os.makedirs(slot_dir, mode=0o700, exist_ok=True)
        elif not os.path.ismount(slot_dir):
            os.makedirs(slot_dir, mode=0o700, exist_ok=True)
            os.chown(slot_dir, uid, uid)
        path = os.path.join(self.socket_dir, f"s-{sid}.sock")
        bridge_fd = self._bridge_fd(bridge)
        listener = _bind(path, self.group)
        try:
            pid, failed = slots.spawn(
                self.tenancy,
                slot,
                slot_dir,
                lambda ready: self._serve(listener, slot_dir, ceiling, ready, bridge_fd),
            )
        finally:
            listener.close()
            if bridge_fd >= 0:
                os.close(bridge_fd)
        if failed:
            _signal(pid, signal.SIGKILL)
            os.unlink(path)
            return _error(failed)
        self.sessions[sid] = pid
        return {"ok": True, "socket": os.path.basename(path), "pid": pid}

    def _serve(
        self, listener: socket.socket, slot_dir: str, ceiling: dict, ready, bridge_fd: int
    ) -> None:
        """In the session process: leave the agent's loop behind and serve the session."""
        self.sel.close()
        self.listener.close()
        if self.lifeline >= 0:
            os.close(self.lifeline)
        for conn in self.buffers:
            conn.close()
        os.setpgid(0, 0)
        # sessions never outlive their agent (set after the uid change, which clears it)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        os.close(self.wakeup_r)
        os.close(self.wakeup_w)
        wakeup_r, wakeup_w = os.pipe()  # a private one: the agent's would race
        os.set_blocking(wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        set_bridge(bridge_fd)
        _serve_session(listener, slot_dir, wakeup_r, ceiling, ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rollout-farm sandbox agent")
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument(
        "--lifeline-fd",
        type=int,
        default=-1,
        help="exit when this pipe closes: the pool that started us is gone",
    )
    parser.add_argument(
        "--session-uids",
        default="",
        help="FIRST:COUNT: session slot i runs as uid FIRST+i (needs root in the sandbox)",
    )
    parser.add_argument("--host-gid", type=int, default=0, help="group of the host's pool")
    parser.add_argument(
        "--private-sessions",
        action="store_true",
        help="give each session its own user, mount, IPC and network namespaces",
    )
    parser.add_argument("--session-ptys", type=int, default=16, help="ptys one session may hold")
    parser.add_argument(
        "--session-memory-mb",
        type=int,
        default=0,
        help="a memory/CPU cgroup per session slot with this memory limit (cgroup v1)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    uids = None
    if args.session_uids:
        first, _, count = args.session_uids.partition(":")
        uids = (int(first), int(count))
    tenancy = slots.Tenancy(args.work_dir, private=args.private_sessions, ptys=args.session_ptys)
    if uids is not None:
        tenancy.first_uid = uids[0]
    if args.session_memory_mb and uids is not None:
        slots.setup_cgroups(tenancy, uids[1], args.session_memory_mb << 20)
    slots.drop_admin()
    if tenancy.private:
        slots.probe(tenancy)
    Agent(args.socket_dir, tenancy, args.lifeline_fd, uids, args.host_gid).serve_forever()
    return 0
