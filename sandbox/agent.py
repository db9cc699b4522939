"""The in-sandbox agent: stdlib only, serves length-prefixed JSON on unix sockets.

One agent runs per sandbox (container or bubblewrap jail), ideally as PID 1 so the
code it runs cannot signal it. It listens on ``<socket-dir>/agent.sock`` for control
requests (``ping``, ``open``, ``close``). ``open`` forks a *session process* with its own
work directory ``<work-dir>/<session>`` and its own socket ``s-<session>.sock``; the
host talks to that socket directly, so a call costs one socket round trip.

A session process serves ``run`` requests one at a time. Each request runs in a fresh
child in its own process group with rlimits (CPU, address space, processes, file size,
open files), a wall-clock timeout that kills the group and every leftover descendant
(the session is a child subreaper), and a cap on captured output. Python code is run
by forking the already-running session interpreter (no exec of a new interpreter),
which keeps every per-call limit but skips interpreter start-up.

Frames are a 4-byte big-endian length and a UTF-8 JSON object; never pickle. A bad
frame gets an error reply and the agent keeps serving; an oversized or cut-off frame
also closes that connection, since the stream cannot be re-synchronised.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import builtins
import errno
import gc
import importlib
import io
import json
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
import traceback

HEADER = struct.Struct(">I")
MAX_FRAME = 64 * 1024 * 1024
SESSION_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
CHUNK = 65536
EXIT_GRACE_S = 0.05  # after the child exits, how long to wait for pipes held by leftovers
KILL_WAIT_S = 2.0  # bound on waiting for killed leftovers to die
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


class FrameError(Exception):
    """A frame could not be decoded; ``fatal`` means the stream cannot continue."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def encode_frame(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise FrameError("connection closed mid-frame", fatal=True)
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> dict | None:
    """Blocking read of one frame; None on a clean end of stream."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (length,) = HEADER.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}", fatal=True)
    body = _recv_exact(sock, length)
    if body is None:
        raise FrameError("connection closed mid-frame", fatal=True)
    return decode_body(body)


try:  # loaded once here: importing ctypes in every forked child would cost milliseconds
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)
except (ImportError, OSError):
    _LIBC = None


def _prctl(option: int, value: int) -> None:
    if _LIBC is not None:  # else degraded: leftovers reparent to PID 1, which reaps them
        _LIBC.prctl(option, value, 0, 0, 0)


def proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None
    once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def _proc_children() -> dict[int, list[int]]:
    """Map pid -> child pids from /proc (only what this pid namespace can see)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := proc_stat(name)) is not None:
            tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def kill_descendants(root: int, keep: frozenset[int] = frozenset()) -> int:
    """Stop, then kill, every descendant of ``root`` except ``keep``; returns how many.

    Stopping first freezes fork bombs that escaped their process group, so the walk
    converges; the kill then removes the frozen tree at once.
    """
    stopped: set[int] = set()
    for _ in range(50):
        tree = _proc_children()
        todo, found = list(tree.get(root, [])), []
        while todo:
            pid = todo.pop()
            if pid in keep:
                continue
            found.append(pid)
            todo.extend(tree.get(pid, []))
        new = [p for p in found if p not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped.update(new)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    _await_dead(stopped, time.monotonic() + KILL_WAIT_S)
    return len(stopped)


def _await_dead(pids: set[int], deadline: float) -> None:
    """Wait until each killed pid has died: a zombie or gone from /proc.

    A SIGKILL is acted on when the target next runs, so without this wait the next
    call could still see a killed process running. Zombies count as dead: their
    parent may be a process we keep, which never reaps them.
    """
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            fields = proc_stat(pid)
            if fields is None or fields[0] in (b"Z", b"X"):
                alive.discard(pid)
        if alive:
            time.sleep(0.001)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(statuses: dict[int, int] | None = None) -> None:
    """Reap every exited child without blocking, recording statuses wanted by caller."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if statuses is not None:
            statuses[pid] = status


def _safe_path(workdir: str, rel: str) -> str:
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"path {rel!r} leaves the work directory")
    return os.path.join(workdir, norm)


# ---- one call: a child with limits, watched by the session process ----------------

ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _apply_limits(limits: dict) -> None:
    cpu = int(limits["cpu_s"])
    pairs = [(resource.RLIMIT_CPU, cpu, cpu + 1)] if cpu > 0 else []
    pairs += [
        (resource.RLIMIT_AS, int(limits["memory_bytes"]), int(limits["memory_bytes"])),
        (resource.RLIMIT_NPROC, int(limits["processes"]), int(limits["processes"])),
        (resource.RLIMIT_FSIZE, int(limits["file_size_bytes"]), int(limits["file_size_bytes"])),
        (resource.RLIMIT_NOFILE, int(limits["open_files"]), int(limits["open_files"])),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    for which, soft, hard in pairs:
        _, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
        resource.setrlimit(which, (min(soft, hard), hard))


class Standby:
    """A child forked ahead of the next call, blocked on its control pipe.

    Forking costs about a millisecond on small VMs; doing it after a reply, while the
    caller is thinking, keeps it off the round trip. The request reaches the child on
    the control pipe; its limits apply from then on, exactly as for a fresh fork.
    """

    def __init__(self) -> None:
        ctl_r, self.ctl_w = os.pipe()
        stdin_r, self.stdin_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.status_r, status_w = os.pipe()
        gc.freeze()  # the child's collector then never walks (and copies) inherited pages
        self.pid = os.fork()
        if self.pid == 0:
            _child((ctl_r, stdin_r, out_w, err_w, status_w))
        for fd in (ctl_r, stdin_r, out_w, err_w, status_w):
            os.close(fd)

    def send(self, req: dict) -> None:
        view = memoryview(encode_frame(req))
        while view:
            view = view[os.write(self.ctl_w, view) :]

    def close_stdin(self) -> None:
        if self.stdin_w >= 0:
            os.close(self.stdin_w)
            self.stdin_w = -1

    def close(self) -> None:
        self.close_stdin()
        for fd in (self.ctl_w, self.out_r, self.err_r, self.status_r):
            os.close(fd)


def _read_ctl(fd: int) -> dict | None:
    buf = b""
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        buf += chunk
        if len(buf) >= HEADER.size and len(buf) >= HEADER.size + HEADER.unpack_from(buf)[0]:
            return json.loads(buf[HEADER.size :])


def _child(fds: tuple[int, int, int, int, int]) -> None:
    """Runs in the forked child; never returns."""
    ctl_r, stdin_r, out_w, err_w, status_w = fds
    code = 127
    try:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(ctl_r, 3)
        os.dup2(status_w, 4)
        os.closerange(5, 1 << 16)
        req = _read_ctl(3)
        if req is None:
            os._exit(0)  # the session went away before using this standby
        os.close(3)
        workdir = req["workdir"]
        os.chdir(workdir)
        env = dict(ENV, HOME=workdir)
        _apply_limits(req["limits"])
        if req.get("argv"):
            os.execvpe(req["argv"][0], req["argv"], env)
        code, tag = _run_python(req["code"], workdir, env)
        if tag:
            os.write(4, tag.encode() + b"\n")
    except BaseException as exc:  # the child must never fall back into the server loop
        try:
            os.write(2, f"sandbox: cannot start: {exc!r}\n".encode())
        except OSError:
            pass
    os._exit(code)


def _run_python(source: str, workdir: str, env: dict) -> tuple[int, str]:
    """Execute ``source`` as ``__main__`` in this interpreter; (exit code, violation tag)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # as CPython does: EFBIG becomes OSError
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace"
    )
    sys.argv = ["-c"]
    sys.path.insert(0, workdir)
    sys.dont_write_bytecode = True  # a stale .pyc must never shadow an edited module
    importlib.invalidate_caches()
    namespace = {"__name__": "__main__", "__builtins__": builtins, "__doc__": None}
    tag, code = "", 0
    try:
        exec(compile(source, "<string>", "exec"), namespace)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        code = 1
        if isinstance(exc, MemoryError):
            tag = "memory"
        elif isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:
            tag = "processes"
        elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            tag = "file_size"
        try:  # from the user's frame on, as `python -c` would print it
            traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        except BaseException:
            pass
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return code, tag


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


class _Capture:
    def __init__(self, cap: int) -> None:
        self.cap, self.data, self.truncated = cap, bytearray(), False

    def feed(self, chunk: bytes) -> bool:
        """Keep up to the cap; True once output went past it."""
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.data += chunk[: max(room, 0)]
            self.truncated = True
        else:
            self.data += chunk
        return self.truncated

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _prepare(req: dict, workdir: str) -> None:
    for rel, b64 in (req.get("files") or {}).items():
        path = _safe_path(workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(b64))


def _collect(req: dict, workdir: str, cap: int) -> dict:
    out = {}
    for rel in req.get("collect") or ():
        try:
            with open(_safe_path(workdir, rel), "rb") as f:
                out[rel] = base64.b64encode(f.read(cap)).decode()
        except (OSError, ValueError):
            continue  # a path the code did not create is simply absent
    return out


def run_request(req: dict, session: SessionState) -> dict:
    """Run one request (worker for Python code, a forked child otherwise); the reply."""
    limits, workdir = req["limits"], session.workdir
    _prepare(req, workdir)
    stdin = base64.b64decode(req["stdin"]) if req.get("stdin") else b""
    deadline = float(req["timeout"])
    if req.get("argv") or req.get("mode") == "fork":
        standby = session.take_standby()
        started = time.monotonic()
        standby.send({k: req.get(k) for k in ("argv", "code", "limits")} | {"workdir": workdir})
        outs = {standby.out_r: _capture(limits), standby.err_r: _capture(limits)}
        state = _watch(standby, outs, stdin, session.wakeup_r, started + deadline)
        duration = time.monotonic() - started
        state["leftovers"] = _cleanup_child(standby.pid, session.keep())
        standby.close()
    else:
        worker = session.take_worker(limits)
        stdin_r, worker.stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        started = time.monotonic()
        worker.dispatch({"code": req["code"], "workdir": workdir}, [stdin_r, out_w, err_w])
        for fd in (stdin_r, out_w, err_w):
            os.close(fd)
        outs = {out_r: _capture(limits), err_r: _capture(limits)}
        state = _watch(worker, outs, stdin, session.wakeup_r, started + deadline)
        duration = time.monotonic() - started
        worker.close_stdin()
        if state.get("worker_ok"):
            session.worker = worker
        else:
            worker.kill()
            state["leftovers"] = _cleanup_child(worker.pid, session.keep())
        for fd in (out_r, err_r):
            os.close(fd)
    state["max_procs"] = int(limits["processes"])
    out, err = outs.values()  # stdout was registered first
    return {
        "ok": True,
        "exit_code": state["exit_code"],
        "stdout": out.text(),
        "stderr": err.text(),
        "stdout_truncated": out.truncated,
        "stderr_truncated": err.truncated,
        "duration_s": duration,
        "violation": _classify(state),
        "files": _collect(req, workdir, int(limits["collect_bytes"])),
    }


def _capture(limits: dict) -> _Capture:
    return _Capture(int(limits["output_bytes"]))


def _watch(
    proc: Standby | PyWorker, outs: dict, stdin: bytes, wakeup_r: int, deadline: float
) -> dict:
    """Feed stdin, capture output, wait for the end of the call or a limit.

    A forked child ends by exiting; the worker ends by sending its reply frame.
    """
    standby = proc
    pid, stdin_w, status_r = proc.pid, proc.stdin_w, proc.status_r
    is_worker = isinstance(proc, PyWorker)
    state = {"status": None, "exit_code": None, "killed": "", "tags": set(), "max_procs": 0}
    sel = selectors.DefaultSelector()
    for fd in outs:
        sel.register(fd, selectors.EVENT_READ)
    sel.register(status_r, selectors.EVENT_READ)
    sel.register(wakeup_r, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(stdin_w, False)
        sel.register(stdin_w, selectors.EVENT_WRITE)
    else:
        standby.close_stdin()
    open_pipes, exited_at, view = set(outs), None, memoryview(stdin)
    while True:
        now = time.monotonic()
        if exited_at is not None and (not open_pipes or now - exited_at > EXIT_GRACE_S):
            break
        if now >= deadline:
            state["killed"] = "timeout"
            break
        wait = deadline - now if exited_at is None else EXIT_GRACE_S
        for key, _ in sel.select(max(wait, 0)):
            fd = key.fd
            if fd == wakeup_r:
                try:
                    os.read(wakeup_r, 4096)
                except BlockingIOError:
                    pass
            elif fd == stdin_w:
                try:
                    view = view[os.write(stdin_w, view[:CHUNK]) :]
                except (BrokenPipeError, OSError):
                    view = view[len(view) :]
                if not view:
                    sel.unregister(stdin_w)
                    standby.close_stdin()
            else:
                chunk = os.read(fd, CHUNK)
                if fd == status_r:
                    if not chunk:
                        sel.unregister(fd)  # a dead worker: its exit status tells the rest
                    elif not is_worker:
                        state["tags"].update(chunk.decode(errors="replace").split())
                    elif exited_at is None and proc.feed_status(chunk):
                        exited_at = time.monotonic()
                elif not chunk:
                    sel.unregister(fd)
                    open_pipes.discard(fd)
                elif outs[fd].feed(chunk):
                    state["killed"] = "output"
        if state["killed"]:
            break
        if exited_at is None and _child_done(pid, state):
            exited_at = time.monotonic()
    sel.close()
    if is_worker and proc.reply is not None and not state["killed"]:
        state["exit_code"] = int(proc.reply["exit_code"])
        state["tags"].add(proc.reply["tag"])
        state["worker_ok"] = not proc.reply["dirty"] and not open_pipes
        return state
    if state["status"] is None:
        _signal(-pid, signal.SIGKILL)
        _, state["status"] = os.waitpid(pid, 0)
    status = state["status"]
    if os.WIFEXITED(status) and not state["killed"]:
        state["exit_code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status) and not state["killed"]:
        state["exit_code"] = -os.WTERMSIG(status)
        state["signal"] = os.WTERMSIG(status)
    return state


def _child_done(pid: int, state: dict) -> bool:
    statuses: dict[int, int] = {}
    reap(statuses)
    if pid in statuses:
        state["status"] = statuses[pid]
        return True
    return False


def _cleanup_child(pid: int, keep: frozenset[int] = frozenset()) -> int:
    """Kill the call's process group and anything that escaped it; returns leftovers."""
    _signal(-pid, signal.SIGKILL)
    while not keep:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break  # something is still alive
        except ChildProcessError:
            return 0  # nothing left: the common, fast path
    reap()
    leftovers = kill_descendants(os.getpid(), keep)
    deadline = time.monotonic() + 5.0
    while leftovers and time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                if keep:
                    break  # the kept processes stay alive; what we killed is reaped later
                time.sleep(0.005)
        except ChildProcessError:
            break
    return leftovers


def _classify(state: dict) -> str:
    tags, sig = state["tags"], state.get("signal")
    if "processes" in tags or state.get("leftovers", 0) >= state["max_procs"] // 2:
        return "processes"
    if "memory" in tags or (sig == signal.SIGKILL):
        return "memory"  # a SIGKILL we did not send is the OOM killer
    if state["killed"] == "output":
        return "output"
    # a shell reports a child killed by signal N as exit status 128 + N
    code = state["exit_code"]
    if "file_size" in tags or signal.SIGXFSZ in (sig, (code or 0) - 128):
        return "file_size"
    if state["killed"] == "timeout" or signal.SIGXCPU in (sig, (code or 0) - 128):
        return "timeout"
    return "none"


# ---- session processes and the control loop ----------------------------------------


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


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(encode_frame(obj))


def _error(message: str) -> dict:
    return {"ok": False, "error": message}


class SessionState:
    """What a session process holds between calls: its work dir and spare processes."""

    def __init__(self, workdir: str, wakeup_r: int) -> None:
        self.workdir, self.wakeup_r = workdir, wakeup_r
        self.standby: Standby | None = None
        self.worker: PyWorker | None = None
        self.last_limits: dict | None = None
        self.forked_last = False

    def keep(self) -> frozenset[int]:
        return frozenset(p.pid for p in (self.standby, self.worker) if p is not None)

    def take_standby(self) -> Standby:
        standby, self.standby = self.standby, None
        self.forked_last = True
        return standby if standby is not None else Standby()

    def take_worker(self, limits: dict) -> PyWorker:
        worker, self.worker = self.worker, None
        self.forked_last, self.last_limits = False, limits
        if worker is not None and not worker.fits(limits):
            worker.kill()
            worker = None
        return worker if worker is not None else PyWorker(limits)

    def refill(self) -> None:
        """After a reply, while the caller thinks: prepare what the next call will use."""
        if self.forked_last and self.standby is None:
            self.standby = Standby()
        elif not self.forked_last and self.worker is None and self.last_limits is not None:
            self.worker = PyWorker(self.last_limits)


def _serve_session(listener: socket.socket, slot_dir: str, wakeup_r: int) -> None:
    """A session process: one connection at a time, one request at a time."""
    os.umask(0o077)
    workdir, tmpdir = os.path.join(slot_dir, "work"), os.path.join(slot_dir, "tmp")
    for path in (workdir, tmpdir):
        os.makedirs(path, mode=0o700, exist_ok=True)
    ENV["TMPDIR"] = tmpdir  # this process and the children it forks: private to the session
    session = SessionState(workdir, wakeup_r)
    while True:
        conn, _ = listener.accept()
        with conn:
            while True:
                try:
                    req = read_frame(conn)
                except FrameError as exc:
                    _send(conn, _error(str(exc)))
                    if exc.fatal:
                        break
                    continue
                except OSError:
                    break
                if req is None:
                    break
                _send(conn, _session_request(req, session))
                session.refill()


def _session_request(req: dict, session: SessionState) -> dict:
    op = req.get("op")
    if op == "ping":
        return {"ok": True, "pid": os.getpid()}
    if op != "run":
        return _error(f"unknown op {op!r}")
    try:
        if not (isinstance(req.get("code"), str) or _is_argv(req.get("argv"))):
            return _error("run needs 'code' (str) or 'argv' (non-empty list of str)")
        if not 0 < float(req["timeout"]) <= 86400:
            return _error("'timeout' must be in (0, 86400] seconds")
        for key in LIMIT_KEYS:
            int(req["limits"][key])
        return run_request(req, session)
    except (KeyError, TypeError, ValueError) as exc:
        return _error(f"bad run request: {exc!r}")
    except OSError as exc:
        return _error(f"run failed: {exc!r}")


LIMIT_KEYS = ("cpu_s", "memory_bytes", "processes", "file_size_bytes", "open_files",
              "output_bytes", "collect_bytes")  # fmt: skip


def _is_argv(argv: object) -> bool:
    return isinstance(argv, list) and bool(argv) and all(isinstance(a, str) for a in argv)


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
        self.first_uid = first if session_uids and os.geteuid() == 0 else None
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
        "--lifeline-fd", type=int, default=-1,
        help="exit when this pipe closes: the pool that started us is gone",
    )  # fmt: skip
    parser.add_argument(
        "--session-uids", default="",
        help="FIRST:COUNT: session slot i runs as uid FIRST+i (needs root in the sandbox)",
    )  # fmt: skip
    parser.add_argument("--host-gid", type=int, default=0, help="group of the host's pool")
    args = parser.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    uids = None
    if args.session_uids:
        first, _, count = args.session_uids.partition(":")
        uids = (int(first), int(count))
    Agent(
        args.socket_dir, args.work_dir, args.lifeline_fd, uids, args.host_gid
    ).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
