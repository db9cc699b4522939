"""The persistent interpreter of a session: serves ``run_python`` without a fork per call.

See `PyWorker`. A worker left dirty (threads, processes), timed out or dead is killed
with everything it started and replaced after the reply.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys

from .call import ENV, _apply_limits, _run_python
from .procs import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, _prctl, _signal, kill_descendants
from .wire import HEADER, encode_frame

WORKER_LIMITS = ("memory_bytes", "processes", "file_size_bytes", "open_files")


class PyWorker:
    """A long-lived interpreter of one session that serves ``run_python`` without a fork.

    Forking costs milliseconds of CPU on small VMs (page tables, copy-on-write faults);
    this process is forked once and then executes each call's code in a fresh
    ``__main__`` namespace, with the call's pipes passed over a socketpair (SCM_RIGHTS).
    Its rlimits (memory, processes, file size, open files) are set once; the wall-clock
    timeout still kills it. After a call it drops modules the call imported and reports
    itself *dirty* when the call left threads or processes behind; a dirty, timed-out or
    dead worker is killed with everything it started and replaced for the next call.
    """

    def __init__(self, limits: dict) -> None:
        self.limits = {k: int(limits[k]) for k in WORKER_LIMITS}
        ours, theirs = socket.socketpair()
        gc.freeze()
        self.pid = os.fork()
        if self.pid == 0:
            ours.close()
            _worker_main(theirs, self.limits)
        theirs.close()
        self.sock = ours
        self.status_r = ours.fileno()
        self.stdin_w = -1
        self.buf = bytearray()
        self.reply: dict | None = None

    def fits(self, limits: dict) -> bool:
        return all(self.limits[k] == int(limits[k]) for k in WORKER_LIMITS)

    def dispatch(self, req: dict, fds: list[int]) -> None:
        body = encode_frame(req)
        socket.send_fds(self.sock, [body[: HEADER.size]], fds)
        self.sock.sendall(body[HEADER.size :])
        self.buf.clear()
        self.reply = None

    def feed_status(self, chunk: bytes) -> bool:
        """Collect the reply frame; True once it is complete."""
        self.buf += chunk
        if len(self.buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(self.buf)
            if len(self.buf) >= HEADER.size + length:
                self.reply = json.loads(bytes(self.buf[HEADER.size : HEADER.size + length]))
                return True
        return False

    def close_stdin(self) -> None:
        if self.stdin_w >= 0:
            os.close(self.stdin_w)
            self.stdin_w = -1

    def kill(self) -> None:
        """Kill the worker and everything it started, and reap them."""
        kill_descendants(self.pid)
        _signal(-self.pid, signal.SIGKILL)
        _signal(self.pid, signal.SIGKILL)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.sock.close()


def _recv_request(sock: socket.socket) -> tuple[dict, list[int]] | None:
    data, fds, _, _ = socket.recv_fds(sock, HEADER.size, 3)
    if not data:
        return None
    buf = bytearray(data)
    while len(buf) < HEADER.size or len(buf) < HEADER.size + HEADER.unpack_from(buf)[0]:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        buf += chunk
    return json.loads(bytes(buf[HEADER.size :])), fds


def _worker_main(sock: socket.socket, limits: dict) -> None:
    """The worker's loop; never returns."""
    try:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # escaped grandchildren stay visible to it
        devnull = os.open(os.devnull, os.O_RDWR)
        keep = sorted((sock.fileno(), devnull))
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[1])
        os.closerange(keep[1] + 1, 1 << 16)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        _apply_limits(dict(limits, cpu_s=0))
        base_path, base_modules = list(sys.path), set(sys.modules)
        me = os.getpid()
        while True:
            got = _recv_request(sock)
            if got is None:
                break
            req, fds = got
            for target, fd in zip((0, 1, 2), fds, strict=True):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(req["workdir"])
            sys.path[:] = base_path
            code, tag = _run_python(req["code"], req["workdir"], dict(ENV, HOME=req["workdir"]))
            if os.getpid() != me:
                os._exit(code)  # a process the code forked must not serve the next call
            dirty = _left_behind()
            for fd in (0, 1, 2):  # the caller sees end of output now
                os.dup2(devnull, fd)
            for name in set(sys.modules) - base_modules:
                del sys.modules[name]  # the next call re-imports the work dir's modules
            sock.sendall(encode_frame({"exit_code": code, "tag": tag, "dirty": dirty}))
    except BaseException:
        pass
    os._exit(0)


def _left_behind() -> bool:
    """True when the call left threads or live processes in this worker."""
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        return True
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
