"""The session's persistent shell: one interactive bash on a pseudo-terminal per session.

cwd, variables, functions and history live in that bash, so they carry over between
calls; jobs started with ``&`` (or ``setsid``, ``nohup``) live until the session ends,
when the agent kills the session's whole process tree. The terminal gives job control:
each foreground job is its own process group and the terminal names it, so a call's
timeout kills that job only (and interrupts the rest of the call's script), never the
background. Output (stdout and stderr together, as on a terminal) is kept up to the cap
and the rest dropped; output that background jobs wrote between calls is shown at the
start of the next call. The end of a call is a marker that ``PROMPT_COMMAND`` prints
with the exit status, so nothing is typed ahead into a running command.

Hostile code in the background meets the same rlimits as in the foreground. A fork
bomb is seen as the shell's process tree holding half the process limit (checked after
each call and before the next), a job the kernel killed (the OOM killer's SIGKILL) from
bash's job notice: both are reported as the call's violation, and a fork bomb's shell
is killed with everything in it, so the next call starts a fresh shell.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import select
import selectors
import signal
import termios
import time

from .call import ENV, _apply_limits
from .procs import (
    PR_SET_PDEATHSIG,
    _prctl,
    _proc_children,
    _signal,
    kill_descendants,
    proc_stat,
    reap,
)

CHUNK = 65536
MARKER_ROOM = 512  # bytes past the cap kept so the end marker is always found
INTERRUPT_GRACE_S = 2.0  # after a timeout, how long bash may take to come back
SIGINT_GRACE_S = 0.2  # how long a timed-out job has to die of SIGINT before SIGKILL
KILLED_JOB = re.compile(rb"^\[\d+\][+-]? +Killed\b", re.MULTILINE)
# bash's word for a refused fork (EAGAIN: the process limit), as a call's EAGAIN is for run
FORK_REFUSED = re.compile(rb"fork: (retry: )?Resource temporarily unavailable")


class Shell:
    """A bash on a pty, in its own session, with the call limits as rlimits."""

    def __init__(self, workdir: str, limits: dict) -> None:
        self.token = secrets.token_hex(8)
        self.marker = re.compile(rb"\n?__farm_" + self.token.encode() + rb"_(\d+)__\n")
        self.master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST  # no \n -> \r\n: the output reads as the program wrote it
        attrs[3] &= ~termios.ECHO  # commands are not echoed back
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.pid = os.fork()
        if self.pid == 0:
            _exec_bash(slave, workdir, limits)
        os.close(slave)
        os.set_blocking(self.master, False)
        # readable once bash ends: background jobs may hold the terminal open after it
        self.pidfd = os.pidfd_open(self.pid)
        self.count = 0
        self.exit_status: int | None = None
        init = (
            "PS1= PS2= PS0= HISTCONTROL=ignorespace HISTFILE=; set +o histexpand;"
            ' __farm_run() { history -s -- "$(< "$1")"; . "$1" < /dev/null; };'
            f" PROMPT_COMMAND='printf \"\\n__farm_{self.token}_%d__\\n\" $?'; history -c\n"
        )
        _write_all(self.master, init.encode())
        if self.read_until_marker(time.monotonic() + 10.0, 1 << 16)[0] is None:
            self.kill()
            raise OSError(errno.EIO, "the shell did not start")

    def alive(self) -> bool:
        """False once bash has ended (an ``exit``, a signal); `exit_status` then says how."""
        if self.exit_status is not None:
            return False
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by the session's sweep: the status is lost
            self.exit_status = -1
            return False
        if pid == 0:
            return True
        self.exit_status = os.waitstatus_to_exitcode(status)
        return False

    def drain(self) -> bytes:
        """What background jobs wrote since the last call."""
        out = bytearray()
        while True:
            try:
                chunk = os.read(self.master, CHUNK)
            except (BlockingIOError, OSError):
                return bytes(out)
            if not chunk:
                return bytes(out)
            out += chunk

    def start(self, command: str, tmpdir: str) -> None:
        self.count += 1
        path = os.path.join(tmpdir, f".farm-shell-{self.count}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(command)
        # the leading space keeps the wrapper itself out of the history
        _write_all(self.master, f" __farm_run {path}\n".encode())

    def read_until_marker(self, deadline: float, cap: int) -> tuple[int | None, bytes, bool]:
        """(exit status or None on deadline/EOF, output up to the cap, truncated)."""
        buf, truncated = bytearray(), False
        sel = selectors.DefaultSelector()
        sel.register(self.master, selectors.EVENT_READ)
        sel.register(self.pidfd, selectors.EVENT_READ)
        try:
            while True:
                found = self.marker.search(buf, max(0, len(buf) - MARKER_ROOM - CHUNK))
                if found:
                    return int(found.group(1)), bytes(buf[: found.start()]), truncated
                wait = deadline - time.monotonic()
                ready = {key.fd for key, _ in sel.select(wait)} if wait > 0 else set()
                if not ready:
                    return None, bytes(buf), truncated
                if self.master not in ready:  # bash ended: keep what it wrote last
                    buf += self.drain()
                    return None, bytes(buf[: cap + MARKER_ROOM]), truncated
                try:
                    chunk = os.read(self.master, CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""  # EIO: bash is gone and the terminal closed
                if not chunk:  # the terminal closed as bash exits: let it finish exiting
                    select.select([self.pidfd], [], [], INTERRUPT_GRACE_S)
                    return None, bytes(buf), truncated
                buf += chunk
                if len(buf) > cap + MARKER_ROOM:
                    # keep the head (the caller's output) and a tail to find the marker in
                    del buf[cap : len(buf) - MARKER_ROOM]
                    truncated = True
        finally:
            sel.close()

    def interrupt(self) -> None:
        """End the foreground job (its whole process group) and the rest of the call.

        As Ctrl-C would: a job that dies of SIGINT makes bash drop the rest of the
        call's script. A job that ignores SIGINT is killed after a short grace.
        """
        try:
            foreground = os.tcgetpgrp(self.master)
        except OSError:
            foreground = self.pid
        if foreground <= 0:  # no terminal any more: never signal our own group (-0)
            foreground = self.pid
        if foreground == self.pid:  # bash itself is busy (a builtin loop)
            _signal(self.pid, signal.SIGINT)
            return
        _signal(-foreground, signal.SIGINT)
        deadline = time.monotonic() + SIGINT_GRACE_S
        while time.monotonic() < deadline and _foreground(self.master) == foreground:
            time.sleep(0.005)
        _signal(-foreground, signal.SIGKILL)

    def kill(self) -> None:
        """Kill bash and everything under it (background jobs included)."""
        kill_descendants(self.pid)
        _signal(self.pid, signal.SIGKILL)
        if self.exit_status is None:
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
        os.close(self.master)
        os.close(self.pidfd)


def _exec_bash(slave: int, workdir: str, limits: dict) -> None:
    """In the forked child: become the terminal's session leader and exec bash."""
    code = 127
    try:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        for fd in (0, 1, 2):
            os.dup2(slave, fd)
        os.closerange(3, 1 << 16)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(workdir)
        # no CPU-seconds limit: it would add up over the session and kill a server
        _apply_limits(dict(limits, cpu_s=0))
        env = dict(ENV, HOME=workdir, TERM="dumb")
        argv = ["bash", "--noprofile", "--norc", "--noediting", "-i"]
        os.execve("/bin/bash", argv, env)
    except BaseException as exc:  # the child must never fall back into the server loop
        try:
            os.write(2, f"sandbox: cannot start the shell: {exc!r}\n".encode())
        except OSError:
            pass
    os._exit(code)


def _foreground(master: int) -> int:
    try:
        return os.tcgetpgrp(master)
    except OSError:
        return -1  # no terminal: never a process group


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [], 1.0)  # the terminal's input queue is full


def run_shell(
    req: dict, shell: Shell | None, workdir: str, tmpdir: str, keep: frozenset[int]
) -> tuple[dict, Shell | None]:
    """One ``shell`` request; the reply and the shell to keep for the next call (``keep``:
    the session's spare processes, spared by a fork bomb's sweep)."""
    limits = req["limits"]
    cap, max_procs = int(limits["output_bytes"]), int(limits["processes"])
    started = time.monotonic()
    pending, violation = b"", "none"
    if shell is not None:
        pending = shell.drain()
        violation = _background_violation(pending, max_procs)
        if violation == "processes" or not shell.alive():
            _end(shell, violation, keep)
            shell = None
        if violation == "processes":  # the bomb was swept; this command did not run
            return _reply(
                None, pending, cap, truncated=False, started=started, violation=violation
            ), None
    if shell is None:
        shell = Shell(workdir, limits)
    shell.start(req["command"], tmpdir)
    status, out, truncated = shell.read_until_marker(started + float(req["timeout"]), cap)
    timed_out = status is None and shell.alive()
    if status is None and not timed_out:
        status = shell.exit_status  # the command ended the shell (`exit 3`)
    if timed_out:
        shell.interrupt()
        back, more, _ = shell.read_until_marker(time.monotonic() + INTERRUPT_GRACE_S, cap)
        out += more
        if back is None:  # bash itself did not come back: it goes, with its jobs
            shell.kill()
            shell = None
    if violation == "none":
        violation = _call_violation(out, status, timed_out, max_procs)
    if shell is not None and (violation == "processes" or not shell.alive()):
        _end(shell, violation, keep)
        shell = None
    return _reply(
        status, pending + out, cap, truncated=truncated, started=started, violation=violation
    ), shell


def _end(shell: Shell, violation: str, keep: frozenset[int]) -> None:
    """Kill the shell's tree; after a fork bomb, also whatever escaped it (setsid and a
    double fork reparent to the session process, a subreaper)."""
    shell.kill()
    if violation == "processes":
        kill_descendants(os.getpid(), keep)
        reap()


def _session_processes() -> int:
    """Live processes under the session process: the shell's tree and anything escaped
    from it (zombies, killed and not yet reaped, do not count)."""
    tree, count = _proc_children(), 0
    todo = list(tree.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        fields = proc_stat(pid)
        count += fields is not None and fields[0] not in (b"Z", b"X")
        todo.extend(tree.get(pid, []))
    return count


def _background_violation(pending: bytes, max_procs: int) -> str:
    if _session_processes() >= max_procs // 2 or FORK_REFUSED.search(pending):
        return "processes"
    return "memory" if KILLED_JOB.search(pending) else "none"


def _call_violation(out: bytes, status: int | None, timed_out: bool, max_procs: int) -> str:
    """As `session._classify` does for one call; a shell reports signal N as 128 + N."""
    if _session_processes() >= max_procs // 2 or FORK_REFUSED.search(out):
        return "processes"
    if KILLED_JOB.search(out) or status == 128 + signal.SIGKILL:
        return "memory"  # a SIGKILL the agent did not send is the OOM killer
    if status == 128 + signal.SIGXFSZ:
        return "file_size"
    if timed_out or status == 128 + signal.SIGXCPU:
        return "timeout"
    return "none"


def _reply(
    status: int | None, out: bytes, cap: int, *, truncated: bool, started: float, violation: str
) -> dict:
    return {
        "ok": True,
        "exit_code": status,
        "stdout": out[:cap].decode("utf-8", errors="replace"),
        "stderr": "",
        "stdout_truncated": truncated or len(out) > cap,
        "stderr_truncated": False,
        "duration_s": time.monotonic() - started,
        "violation": violation,
        "files": {},
    }
