"""The session's interactive bash on a pseudo-terminal, and the framing of one call.

A call writes the command to a file of the session's tmp (a fresh random name, created
exclusively, never through a link) and types one line that sources it with its output
on the terminal. The end of a call is told in two steps, so that nothing the command
prints or reads can end it early:

1. at every prompt, ``PROMPT_COMMAND`` prints a *ready* marker (no secret in it: any
   output may contain one);
2. on a ready marker, once bash itself holds the terminal and sleeps (no foreground job
   can read what is typed), the session types a line with a fresh random nonce; bash
   runs it at its prompt and prints the nonce with the command's exit status.

The nonce exists only in the session process until the command has ended, so no
variable, file or process of the session holds it while its command runs. Every call
also restores the terminal modes, the prompt variables and the shell options that would
break the framing (``stty echo``, ``set -u``, ``set -x``, ``PS1``); the command's own
output goes through a duplicate of bash's terminal descriptor, so an ``exec >&-`` lasts
only for its call. Output from background jobs that arrives between calls is drained
(capped in bytes and time) at the start of the next call.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import select
import selectors
import shlex
import signal
import termios
import time

from .call import ENV, _apply_limits
from .paths import open_file
from .procs import PR_SET_PDEATHSIG, _prctl, _signal, kill_descendants, proc_stat

CHUNK = 65536
SLACK = 4096  # bytes kept past the output cap, so markers at its edge are still removed
SCAN_TAIL = 80  # bytes of the previous chunk scanned again: a marker may straddle chunks
DRAIN_S = 0.2  # most time spent draining background output before a call
RETYPE_S = 0.5  # a nonce line typed on a false ready marker is typed again after this
INTERRUPT_GRACE_S = 2.0  # after a timeout, how long bash may take to come back
SIGINT_GRACE_S = 0.2  # how long a timed-out job has to die of SIGINT before SIGKILL
# bash writes a marker's leading newline (which puts it on a line of its own) apart from
# the rest (its stdout is line-buffered), so a background job's output may come between;
# the ready marker may also come through output modes the command set (onlcr, olcuc)
READY = re.compile(rb"__farm_ready__\r*\n", re.IGNORECASE)
DONE = re.compile(rb"__farm_done_([0-9a-f]{32})_(\d+)__\n")
MARKERS = re.compile(rb"\r?\n?__farm_(?:ready|done_[0-9a-f]{32}_\d+)__\r*\n", re.IGNORECASE)
# run at every prompt: saves the status, then undoes what would break the framing (the
# terminal descriptors are opened afresh: the command may have closed or moved them)
PROMPT_COMMAND = (
    "{ __farm_st=$?; set +o errexit +o nounset +o xtrace +o verbose; } 2>/dev/null;"
    " exec 0</dev/tty 1>/dev/tty 2>/dev/tty; PS1= PS2= PS0= HISTCONTROL=ignorespace;"
    " if [[ -n ${__farm_q-} ]]; then __farm_q=; else \\printf '\\n__farm_ready__\\n'; fi"
)


class Shell:
    """A bash on a pty, in its own session, with the call limits as rlimits."""

    def __init__(self, workdir: str, tmpdir: str, limits: dict) -> None:
        self.tmpdir = tmpdir
        self.master, slave = os.openpty()
        # the code's processes get the terminal write-only: none can read what is typed
        writer = os.open(os.ttyname(slave), os.O_WRONLY | os.O_NOCTTY)
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST  # no \n -> \r\n: the output reads as the program wrote it
        attrs[3] &= ~termios.ECHO  # commands are not echoed back
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.attrs = attrs
        self.pid = os.fork()
        if self.pid == 0:
            _exec_bash(slave, writer, workdir, limits)
        os.close(slave)
        os.close(writer)
        os.set_blocking(self.master, False)
        # readable once bash ends: background jobs may hold the terminal open after it
        self.pidfd = os.pidfd_open(self.pid)
        self.exit_status: int | None = None
        self.last_file = ""
        self.carry = b""  # output that arrived after the last call's end marker
        self._begin()
        self._type(f" {_assign_prompt()} HISTFILE=; set +o histexpand; history -c")
        if self.read(time.monotonic() + 10.0, 1 << 16)[0] is None:
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

    def drain(self, cap: int) -> bytes:
        """What background jobs wrote since the last call: the first ``cap`` bytes of
        what is there now, read for at most `DRAIN_S` (a flood never ends by itself)."""
        out, deadline = bytearray(self.carry), time.monotonic() + DRAIN_S
        self.carry = b""
        while time.monotonic() < deadline:
            try:
                chunk = os.read(self.master, CHUNK)
            except OSError:  # EAGAIN: nothing more now; EIO: bash is gone
                break
            if not chunk:
                break
            out += chunk[: max(0, cap + SLACK - len(out))]
        return MARKERS.sub(b"", bytes(out))

    def start(self, command: str) -> None:
        """Write the command to a fresh file and type the line that runs it; OSError when
        the code made its tmp unusable (the model's error)."""
        if self.last_file:
            try:
                os.unlink(self.last_file, dir_fd=None)
            except OSError:
                pass
        _give_back(self.tmpdir)
        name = f".farm-shell-{secrets.token_hex(8)}"
        fd = open_file(self.tmpdir, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with open(fd, "w", encoding="utf-8") as f:
            f.write(command)
        path = self.last_file = os.path.join(self.tmpdir, name)
        self._begin()
        # the leading space keeps the line itself out of the history
        quoted = shlex.quote(path)
        self._type(
            f' {_assign_prompt()} __farm_q=; history -s -- "$(< {quoted})";'
            f" . {quoted} </dev/null >/dev/tty 2>&1"
        )

    def _begin(self) -> None:
        termios.tcsetattr(self.master, termios.TCSANOW, self.attrs)  # `stty` lasts one call
        self.nonces: set[str] = set()
        self.typed_at = self.ready_at = 0.0
        self.ready = False  # a ready marker was seen and no nonce line typed since

    def read(self, deadline: float, cap: int) -> tuple[int | None, bytes, bool]:
        """Read the call's output until its end (exit status) or the deadline / bash's
        end (None); the output has no markers, at most ``cap`` bytes, and truncated."""
        head, tail, truncated = bytearray(), b"", False
        sel = selectors.DefaultSelector()
        sel.register(self.master, selectors.EVENT_READ)
        sel.register(self.pidfd, selectors.EVENT_READ)
        try:
            while True:
                now = time.monotonic()
                if self.ready and (not self.nonces or now - self.typed_at > RETYPE_S):
                    self._type_nonce()
                wait = deadline - now
                if self.ready:  # bash may not sleep at its prompt yet: look again soon
                    wait = min(wait, 0.005 if now - self.ready_at < 0.1 else 0.05)
                ready = {key.fd for key, _ in sel.select(wait)} if wait > 0 else set()
                if not ready and time.monotonic() >= deadline:
                    return None, _clean(head, cap), truncated
                if self.master not in ready:
                    if self.pidfd in ready:  # bash ended: keep what it wrote last
                        head += self.drain(cap)
                        return None, _clean(head, cap), truncated
                    continue
                try:
                    chunk = os.read(self.master, CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""  # EIO: no process holds the terminal open now
                if not chunk:
                    # bash is exiting, or the command closed every descriptor of the
                    # terminal (the prompt hook opens it again): bash's end tells which
                    if select.select([self.pidfd], [], [], 0.01)[0]:
                        return None, _clean(head, cap), truncated
                    continue
                window = tail + chunk
                end = self._find_end(window, len(tail))
                keep = chunk if end is None else chunk[: max(0, end[1] - len(tail))]
                if end is not None:
                    self.carry = chunk[len(keep) :]
                room = cap + SLACK - len(head)
                truncated |= len(keep) > room
                head += keep[: max(room, 0)]
                if end is not None:
                    return end[0], _clean(head, cap), truncated or len(head) > cap + SLACK
                tail = window[-SCAN_TAIL:]
        finally:
            sel.close()

    def _find_end(self, window: bytes, old: int) -> tuple[int, int] | None:
        """(status, end offset in ``window``) of this call's end marker; notes new ready
        markers (those not wholly in the first ``old`` bytes, already scanned)."""
        for found in DONE.finditer(window):
            if found.group(1).decode() in self.nonces:
                return int(found.group(2)), found.end()
        for found in READY.finditer(window):
            if found.end() > old and not self.ready:
                self.ready, self.ready_at = True, time.monotonic()
        return None

    def _type_nonce(self) -> None:
        """Type the nonce line, but only while bash holds the terminal and sleeps."""
        if _foreground(self.master) != self.pid or (proc_stat(self.pid) or [b""])[0] != b"S":
            return
        termios.tcsetattr(self.master, termios.TCSANOW, self.attrs)
        nonce = secrets.token_hex(16)
        self.nonces.add(nonce)
        self.typed_at, self.ready = time.monotonic(), False
        self._type(f" __farm_q=1; \\printf '\\n__farm_done_{nonce}_%d__\\n' \"$__farm_st\"")

    def _type(self, line: str) -> None:
        _write_all(self.master, line.encode() + b"\n")

    def interrupt(self) -> None:
        """End the foreground job (its whole process group) and the rest of the call.

        As Ctrl-C would: a job that dies of SIGINT makes bash drop the rest of the
        call's script. A job that ignores SIGINT is killed after a short grace.
        """
        foreground = _foreground(self.master)
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


def _give_back(directory: str) -> None:
    """Make the session's own tmp usable again if the code took its modes away (it owns
    it); never through a link the code put in its place."""
    try:
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # gone or replaced: writing the command file says so
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
    except OSError:
        pass
    finally:
        os.close(fd)


def _assign_prompt() -> str:
    """The shell words that (re)install the prompt hook, typed with every call."""
    return f"PROMPT_COMMAND={shlex.quote(PROMPT_COMMAND)};"


def _clean(head: bytearray, cap: int) -> bytes:
    return MARKERS.sub(b"", bytes(head))[: cap + 1]


def _exec_bash(slave: int, writer: int, workdir: str, limits: dict) -> None:
    """In the forked child: become the terminal's session leader and exec bash."""
    code = 127
    try:
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        os.dup2(slave, 0)
        os.dup2(writer, 1)
        os.dup2(writer, 2)
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
