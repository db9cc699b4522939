"""The reaper: process-tree walks over /proc, stop-then-kill sweeps, zombie reaping.

Used by the agent (ending a session's tree), the session (a call's leftovers) and the
host (`reap_orphan_jails` reads `proc_stat`). Only what the caller's pid namespace shows.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

KILL_WAIT_S = 2.0  # bound on waiting for killed leftovers to die
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


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

    def descendants() -> list[int]:
        tree = _proc_children()
        todo, found = list(tree.get(root, [])), []
        while todo:
            pid = todo.pop()
            if pid in keep:
                continue
            found.append(pid)
            todo.extend(tree.get(pid, []))
        return found

    return _stop_then_kill(descendants)


def kill_uid(uid: int) -> int:
    """Stop, then kill, every process whose real uid is ``uid`` (but the caller); returns
    how many. A closed session's whole uid goes, whatever tree its processes escaped to."""
    me = os.getpid()
    return _stop_then_kill(lambda: [pid for pid in _pids_of(uid) if pid != me])


def _stop_then_kill(find: Callable[[], list[int]]) -> int:
    """SIGSTOP what `find` lists until a walk finds nothing new (at most 50 walks), then
    SIGKILL every stopped pid and wait for them; returns how many."""
    stopped: set[int] = set()
    for _ in range(50):
        new = [pid for pid in find() if pid not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped.update(new)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    _await_dead(stopped, time.monotonic() + KILL_WAIT_S)
    return len(stopped)


def _pids_of(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        line = status[status.find(b"\nUid:") + 5 :].split(None, 1)
        fields = proc_stat(name)
        if line and int(line[0]) == uid and fields and fields[0] not in (b"Z", b"X"):
            pids.append(int(name))
    return pids


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
