"""The agent's control loop: accepts connections, opens and closes sessions.

One agent runs per sandbox, ideally as PID 1 so the code it runs cannot signal it. It
listens on ``<socket-dir>/agent.sock`` for ``ping``, ``open`` and ``close``; ``open``
forks a session process (see `.session`) with its own socket ``s-<session>.sock``,
which the host then talks to directly.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import selectors
import shutil
import signal
import socket

from .procs import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    _prctl,
    _signal,
    kill_descendants,
    reap,
)
from .session import _serve_session
from .wire import HEADER, MAX_FRAME, FrameError, _error, decode_body, encode_frame

SESSION_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


def _bind(path: str) -> socket.socket:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0)  # the host side may be another uid; the directory guards access
    try:
        sock.bind(path)
    finally:
        os.umask(old)
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
        work_dir: str,
        lifeline: int = -1,
        session_uids: tuple[int, int] | None = None,
        host_gid: int = 0,
    ) -> None:
        self.socket_dir, self.work_dir, self.lifeline = socket_dir, work_dir, lifeline
        self.sessions: dict[str, int] = {}
        self.slots: dict[str, int] = {}  # session id -> slot, kept across a reopen
        first, count = session_uids or (0, 0)
        if session_uids and os.geteuid() != 0:
            # asked to isolate sessions and unable to: never fall back to a shared uid
            raise PermissionError("--session-uids needs root in the sandbox to switch uids")
        self.first_uid = first if session_uids else None
        self.free = list(range(count)) if self.first_uid is not None else []
        if self.first_uid is not None:
            # only the agent and the host's group may enter: no session reaches a socket
            os.chown(socket_dir, 0, host_gid)
            os.chmod(socket_dir, 0o770)
        self.sel = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytearray] = {}
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(self.wakeup_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wakeup_w)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.listener = _bind(os.path.join(socket_dir, "agent.sock"))
        self.sel.register(self.listener, selectors.EVENT_READ)
        self.sel.register(self.wakeup_r, selectors.EVENT_READ)
        if lifeline >= 0:
            self.sel.register(lifeline, selectors.EVENT_READ)

    def serve_forever(self) -> None:
        gc.freeze()  # keep the session forks' copy-on-write pages shared
        while True:
            for key, _ in self.sel.select():
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
            return {"ok": True, "pid": os.getpid(), "sessions": len(self.sessions)}
        if op not in ("open", "close"):
            return _error(f"unknown op {op!r}")
        if not isinstance(sid, str) or not SESSION_RE.match(sid):
            return _error("'session' must match [A-Za-z0-9_-]{1,40}")
        self._stop_session(sid)
        if op == "close":
            self._wipe(sid)
            return {"ok": True}
        if self.first_uid is not None and sid not in self.slots:
            if not self.free:
                return _error("no free session slot in this sandbox")
            self.slots[sid] = self.free.pop()
        return self._open(sid)

    def _slot_dir(self, sid: str) -> str:
        return os.path.join(self.work_dir, str(self.slots.get(sid, sid)))

    def _uid(self, sid: str) -> int | None:
        return None if self.first_uid is None else self.first_uid + self.slots[sid]

    def _wipe(self, sid: str) -> None:
        """Delete a closed session's files, as its own uid (the agent cannot read them)."""
        slot_dir, uid = self._slot_dir(sid), self._uid(sid) if sid in self.slots else None
        if uid is None:
            shutil.rmtree(slot_dir, ignore_errors=True)
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _drop_to(uid)
                _empty(slot_dir)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status == 0:  # a slot whose files survived is never handed out again
            self.free.append(self.slots[sid])
        del self.slots[sid]

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

    def _open(self, sid: str) -> dict:
        slot_dir, uid = self._slot_dir(sid), self._uid(sid)
        if uid is None:
            os.makedirs(slot_dir, mode=0o700, exist_ok=True)
        elif not os.path.ismount(slot_dir):
            os.makedirs(slot_dir, mode=0o700, exist_ok=True)
            os.chown(slot_dir, uid, uid)
        path = os.path.join(self.socket_dir, f"s-{sid}.sock")
        listener = _bind(path)
        pid = os.fork()
        if pid == 0:
            self._become_session(listener, slot_dir, uid)
        listener.close()
        self.sessions[sid] = pid
        return {"ok": True, "socket": os.path.basename(path), "pid": pid}

    def _become_session(self, listener: socket.socket, slot_dir: str, uid: int | None) -> None:
        code = 0
        try:
            self.sel.close()
            self.listener.close()
            if self.lifeline >= 0:
                os.close(self.lifeline)
            for conn in self.buffers:
                conn.close()
            os.setpgid(0, 0)
            if uid is not None:
                _drop_to(uid)
            # after the uid change, which clears it: sessions never outlive their agent
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
            os.close(self.wakeup_r)
            os.close(self.wakeup_w)
            wakeup_r, wakeup_w = os.pipe()  # a private one: the agent's would race
            os.set_blocking(wakeup_r, False)
            os.set_blocking(wakeup_w, False)
            signal.set_wakeup_fd(wakeup_w)
            _serve_session(listener, slot_dir, wakeup_r)
        except BaseException:
            code = 1
        os._exit(code)


def _drop_to(uid: int) -> None:
    """Become ``uid`` for good: no groups, no capabilities, no way back up."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to non-root: every capability set is cleared
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if os.getuid() != uid or os.geteuid() != uid:
        raise PermissionError(f"could not become uid {uid}")


def _empty(path: str) -> None:
    """Remove everything under ``path`` (kept: it may be a mount point), first giving
    back to its owner the directory permissions the code may have taken away."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            target = os.path.join(root, name)
            if not os.path.islink(target):
                os.chmod(target, 0o700)
    for name in os.listdir(path):
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.unlink(target)


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
    args = parser.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    uids = None
    if args.session_uids:
        first, _, count = args.session_uids.partition(":")
        uids = (int(first), int(count))
    Agent(args.socket_dir, args.work_dir, args.lifeline_fd, uids, args.host_gid).serve_forever()
    return 0
