"""A ``shell`` call in the session's persistent shell (`.terminal`): limits and violations.

cwd, variables, functions and history live in that bash, so they carry over between
calls; jobs started with ``&`` (or ``setsid``, ``nohup``) live until the session ends,
when the agent kills the session's whole process tree. The terminal gives job control:
each foreground job is its own process group and the terminal names it, so a call's
timeout kills that job only (and interrupts the rest of the call's script), never the
background. Output (stdout and stderr together, as on a terminal) is kept up to the cap
and the rest dropped; output that background jobs wrote between calls is shown at the
start of the next call.

Hostile code in the background meets the same rlimits as in the foreground. A fork
bomb is seen as the shell's process tree holding half the process limit (checked after
each call and before the next), a job the kernel killed (the OOM killer's SIGKILL) from
bash's job notice: both are reported as the call's violation, and a fork bomb's shell
is killed with everything in it, so the next call starts a fresh shell. A command file
that cannot be written (the code made its tmp unusable) is the model's error: exit
status 126 and a message, never a failure of the sandbox.
"""

from __future__ import annotations

import os
import re
import signal
import time

from .procs import _proc_children, kill_descendants, proc_stat, reap
from .terminal import INTERRUPT_GRACE_S, Shell

KILLED_JOB = re.compile(rb"^\[\d+\][+-]? +Killed\b", re.MULTILINE)
# bash's word for a refused fork (EAGAIN: the process limit), as a call's EAGAIN is for run
FORK_REFUSED = re.compile(rb"fork: (retry: )?Resource temporarily unavailable")


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
        # at most half the cap: the command's own output always has room after it
        pending = shell.drain(cap // 2)
        violation = _background_violation(pending, max_procs)
        if violation == "processes" or not shell.alive():
            _end(shell, violation, keep)
            shell = None
        if violation == "processes":  # the bomb was swept; this command did not run
            return _reply(
                None, pending, cap, truncated=False, started=started, violation=violation
            ), None
    try:
        if shell is None:
            shell = Shell(workdir, tmpdir, limits)
        shell.start(req["command"])
    except OSError as exc:  # its ptys used up, its tmp unusable: the code's doing
        message = f"sandbox: cannot run the command: {exc.strerror or exc}\n".encode()
        reply = _reply(
            126, pending + message, cap, truncated=False, started=started, violation=violation
        )
        return reply, shell
    status, out, truncated = shell.read(started + float(req["timeout"]), cap)
    timed_out = status is None and shell.alive()
    if status is None and not timed_out:
        status = shell.exit_status  # the command ended the shell (`exit 3`)
    if timed_out:
        shell.interrupt()
        back, more, _ = shell.read(time.monotonic() + INTERRUPT_GRACE_S, cap)
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
