"""The session process: serves ``run`` requests one at a time on its own socket.

Each request runs in the session's interpreter (`PyWorker`) or a fresh child
(`Standby`), watched for the wall-clock timeout and the output cap, then its leftovers
are swept (the session is a child subreaper) and the result is classified.
"""

from __future__ import annotations

import base64
import os
import selectors
import signal
import socket
import time

from .call import CEILING, ENV, Standby, _safe_path, clamp
from .files import file_request
from .interpreter import PyWorker
from .paths import WRITE_FLAGS, open_file, own_dir
from .procs import _signal, kill_descendants, reap
from .shell import run_shell
from .terminal import Shell
from .wire import FrameError, _error, _send, read_frame

CHUNK = 65536
EXIT_GRACE_S = 0.05  # after the child exits, how long to wait for pipes held by leftovers


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
    """Write the call's ``files``; a path the code made a link or a FIFO is refused
    (OSError), as the model's error."""
    for rel, b64 in (req.get("files") or {}).items():
        _safe_path(workdir, rel)
        fd = open_file(workdir, os.path.normpath(rel), WRITE_FLAGS, create_parents=True)
        with open(fd, "wb") as f:
            f.write(base64.b64decode(b64))


def _collect(req: dict, workdir: str, cap: int) -> dict:
    out = {}
    for rel in req.get("collect") or ():
        try:
            _safe_path(workdir, rel)
            fd = open_file(workdir, os.path.normpath(rel), os.O_RDONLY)
        except (OSError, ValueError):
            continue  # a path the code did not create (or made a link) is simply absent
        with open(fd, "rb") as f:
            out[rel] = base64.b64encode(f.read(cap)).decode()
    return out


def run_request(req: dict, session: SessionState) -> dict:
    """Run one request (worker for Python code, a forked child otherwise); the reply."""
    limits, workdir = req["limits"], session.workdir
    try:
        _prepare(req, workdir)
    except OSError as exc:  # the code made a path unwritable: its doing, not ours
        return _refused(f"sandbox: cannot write the call's files: {exc.strerror or exc}")
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


def _refused(message: str) -> dict:
    """The call could not start because of what the code did to its own files: the
    model's error (exit status 126, this message on stderr), never the sandbox's."""
    return {
        "ok": True,
        "exit_code": 126,
        "stdout": "",
        "stderr": message + "\n",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "duration_s": 0.0,
        "violation": "none",
        "files": {},
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


class SessionState:
    """What a session process holds between calls: its work dir and spare processes."""

    def __init__(self, workdir: str, tmpdir: str, wakeup_r: int) -> None:
        self.workdir, self.tmpdir, self.wakeup_r = workdir, tmpdir, wakeup_r
        self.shell: Shell | None = None  # started by the first shell call, kept to the end
        self.standby: Standby | None = None
        self.worker: PyWorker | None = None
        self.last_limits: dict | None = None
        self.forked_last = False

    def keep(self) -> frozenset[int]:
        # the shell's tree (its background jobs) is kept too: it lives until the session ends
        return frozenset(p.pid for p in (self.standby, self.worker, self.shell) if p is not None)

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


def _serve_session(
    listener: socket.socket, slot_dir: str, wakeup_r: int, ceiling: dict, ready
) -> None:
    """A session process: one connection at a time, one request at a time. ``ceiling``
    bounds every call's limits; ``ready()`` tells the agent the session is up."""
    os.umask(0o077)
    CEILING.update(ceiling)
    os.chmod(slot_dir, 0o700)  # reopened after the code took its modes away: its own
    slot = os.open(slot_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    for name in ("work", "tmp"):
        os.close(own_dir(slot, name))  # a link the code left at its place is not followed
    os.close(slot)
    workdir, tmpdir = os.path.join(slot_dir, "work"), os.path.join(slot_dir, "tmp")
    ENV["TMPDIR"] = tmpdir  # this process and the children it forks: private to the session
    session = SessionState(workdir, tmpdir, wakeup_r)
    ready()
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
                try:
                    session.refill()
                except OSError:
                    pass  # no fork now (the process limit): the next call forks its own


def _session_request(req: dict, session: SessionState) -> dict:
    op = req.get("op")
    if op == "ping":
        return {"ok": True, "pid": os.getpid()}
    if op == "file":
        cap = min(int(req.get("cap", 1 << 20)), CEILING.get("collect_bytes", 1 << 20))
        return file_request(req, session.workdir, cap)
    if op not in ("run", "shell"):
        return _error(f"unknown op {op!r}")
    try:
        if op == "shell":
            return _shell_request(req, session)
        if not (isinstance(req.get("code"), str) or _is_argv(req.get("argv"))):
            return _error("run needs 'code' (str) or 'argv' (non-empty list of str)")
        if not 0 < float(req["timeout"]) <= 86400:
            return _error("'timeout' must be in (0, 86400] seconds")
        req["limits"] = clamp(req["limits"])
        return run_request(req, session)
    except (KeyError, TypeError, ValueError) as exc:
        return _error(f"bad run request: {exc!r}")
    except OSError as exc:
        return _error(f"run failed: {exc!r}")


def _shell_request(req: dict, session: SessionState) -> dict:
    if not isinstance(req.get("command"), str):
        return _error("shell needs 'command' (str)")
    if not 0 < float(req["timeout"]) <= 86400:
        return _error("'timeout' must be in (0, 86400] seconds")
    req["limits"] = clamp(req["limits"])
    spares = frozenset(p.pid for p in (session.standby, session.worker) if p is not None)
    reply, session.shell = run_shell(req, session.shell, session.workdir, session.tmpdir, spares)
    return reply


def _is_argv(argv: object) -> bool:
    return isinstance(argv, list) and bool(argv) and all(isinstance(a, str) for a in argv)
