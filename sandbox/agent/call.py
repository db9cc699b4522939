"""One call in a fresh child: the pre-forked standby, its rlimits, running Python source.

The session keeps one child forked ahead (`Standby`), blocked on a pipe; the request
reaches it there, it sets its process group and limits, changes into the work dir and
execs the program or runs the code as ``__main__`` in the interpreter it inherited.
"""

from __future__ import annotations

import atexit
import builtins
import errno
import gc
import importlib
import io
import json
import os
import resource
import signal
import sys
import traceback

from .procs import PR_SET_PDEATHSIG, _prctl
from .wire import HEADER, encode_frame


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


LIMIT_KEYS = (
    "cpu_s",
    "memory_bytes",
    "processes",
    "file_size_bytes",
    "open_files",
    "output_bytes",
    "collect_bytes",
)
# every process a call starts holds the session's bridge here, when it has one: a path-only
# descriptor of the host's socket, reached with connect("/proc/self/fd/5") (`.relay`)
BRIDGE_FD = 5
_bridge = [-1]  # the session process's own descriptor of it (set once, high above BRIDGE_FD)


def set_bridge(fd: int) -> None:
    """In the session process: keep ``fd`` (or -1: none) for every call's child."""
    if fd >= 0:
        import fcntl

        _bridge[0] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64)
        os.close(fd)


# the limits the session was opened with (set once in the session process, inherited by
# every process it forks): no request, forged or not, gets more
CEILING: dict[str, int] = {}


def clamp(limits: dict) -> dict[str, int]:
    """A call's limits, each at most the session's ceiling; KeyError/ValueError if bad."""
    out = {k: int(limits[k]) for k in LIMIT_KEYS}
    for key, top in CEILING.items():
        out[key] = min(out[key], top)
    return out


def _apply_limits(limits: dict) -> None:
    limits = {k: min(int(v), CEILING.get(k, int(v))) for k, v in limits.items()}
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
        if _bridge[0] >= 0:
            os.dup2(_bridge[0], BRIDGE_FD)
        os.closerange(BRIDGE_FD + (_bridge[0] >= 0), 1 << 16)
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
