"""Session slots of one sandbox: how a session process is made, and what its close leaves.

`Tenancy` holds what the agent decided at start about isolating sessions: a uid per
slot (the Docker backend), per-session namespaces (`.tenant`), a memory/CPU cgroup per
slot (`.cgroups`). `become_session` runs in the forked child and turns it into a session
process; `wipe` runs in a forked child after the session's processes are gone and
removes its files, whatever the code did to them. Both report failures to the agent
rather than raise in it: the agent is PID 1 and must outlive anything a session does.
"""

from __future__ import annotations

import os
import select
import signal
from dataclasses import dataclass, field

from . import tenant
from .cgroups import Groups, missing, v1_mounts
from .paths import empty
from .procs import PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, _prctl, _signal

WIPE_TIMEOUT_S = 8.0  # under the host's control timeout: a slow wipe fails, never hangs
READY_TIMEOUT_S = 10.0


@dataclass
class Tenancy:
    """How sessions are isolated in this sandbox (fixed at the agent's start)."""

    work_dir: str
    first_uid: int | None = None  # slot i runs as first_uid + i; None: the agent's uid
    private: bool = False  # per-session namespaces (see `.tenant`)
    ptys: int = 16
    cgroups: dict[str, str] = field(default_factory=dict)  # controller -> mount, if made
    problems: dict[str, str] = field(default_factory=dict)  # bound -> why it is missing

    def uid(self, slot: int | None) -> int | None:
        return None if self.first_uid is None or slot is None else self.first_uid + slot

    def groups(self, slot: int) -> Groups | None:
        return Groups.under_mounts(self.cgroups, f"farm-s{slot}") if self.cgroups else None


def setup_cgroups(tenancy: Tenancy, slots: int, memory_bytes: int) -> None:
    """A memory/CPU cgroup per slot under the container's own (cgroup v1), made writable
    for that (with SYS_ADMIN, which `drop_admin` then gives up)."""
    try:
        mounts = v1_mounts()
        why = missing(mounts)
        if why:
            tenancy.problems["cgroups"] = why
            return
        for mount in {*mounts.values()}:
            tenant.remount(mount, read_only=False)
        for slot in range(slots):
            Groups.under_mounts(mounts, f"farm-s{slot}").make(memory_bytes=memory_bytes)
        tenancy.cgroups = mounts
    except OSError as exc:
        tenancy.problems["cgroups"] = str(exc)


def drop_admin() -> None:
    """Give up SYS_ADMIN for good (effective and permitted sets): what needed it (the
    cgroups) is done, and the agent never execs, so nothing gives it back."""
    tenant.set_caps(tenant.capabilities() & ~(1 << tenant.CAP_SYS_ADMIN))


def probe(tenancy: Tenancy) -> None:
    """Try, in a throw-away child as a session would be, what `.tenant` needs."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        message = b""
        try:
            uid = tenancy.uid(0)
            if uid is not None:
                drop_to(uid)
            _prctl(PR_SET_DUMPABLE, 1)  # the id maps are written through /proc/self
            tenant.probe()
        except BaseException as exc:  # reported to the parent as text
            message = str(exc).encode() or repr(exc).encode()
        os.write(write_fd, message)
        os._exit(0)
    os.close(write_fd)
    message = _read_all(read_fd, READY_TIMEOUT_S)
    os.waitpid(pid, 0)
    if message:
        tenancy.problems["namespaces"] = message.decode(errors="replace")
        tenancy.private = False


def spawn(tenancy: Tenancy, slot: int | None, slot_dir: str, serve) -> tuple[int, str]:
    """Fork a session process for ``slot``; (pid, '' or why it could not start).

    ``serve(ready)`` runs in the child once it is a session: it calls ``ready()`` and then
    serves forever.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(tenancy, slot, slot_dir, serve, write_fd)
    os.close(write_fd)
    message = _read_all(read_fd, READY_TIMEOUT_S)
    if message != b"ready":
        return pid, message.decode(errors="replace") or "the session process died"
    return pid, ""


def _child(tenancy: Tenancy, slot: int | None, slot_dir: str, serve, ready_fd: int) -> None:
    code = 1
    try:
        groups = tenancy.groups(slot) if slot is not None else None
        if groups is not None:
            groups.join()  # still root: the cgroup files are the agent's
        uid = tenancy.uid(slot)
        if uid is not None:
            drop_to(uid)
        if tenancy.private:
            # a non-dumpable process's /proc/self files are root's: the id maps need ours
            _prctl(PR_SET_DUMPABLE, 1)
            tenant.enter(slot_dir, tenancy.work_dir, tenancy.ptys)
        # no session may read the session process's memory or descriptors (on bwrap the
        # code runs as the same uid; on Docker the uid change already did this)
        _prctl(PR_SET_DUMPABLE, 0)

        def ready() -> None:
            os.write(ready_fd, b"ready")
            os.close(ready_fd)

        serve(ready)
        code = 0
    except BaseException as exc:  # the child must never return into the agent
        try:
            os.write(ready_fd, f"session setup failed: {exc}".encode())
        except OSError:
            pass
    os._exit(code)


def wipe(tenancy: Tenancy, slot: int | None, slot_dir: str, remove_dir: bool) -> bool:
    """Delete a closed session's files as its own uid (the agent cannot read them); True
    when nothing is left. Runs in a child bounded by `WIPE_TIMEOUT_S`."""
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:
        code = 1
        try:
            uid = tenancy.uid(slot)
            if uid is not None:
                drop_to(uid)
            if os.path.isdir(slot_dir):
                empty(slot_dir)
                if remove_dir:
                    os.chdir("/")
                    os.rmdir(slot_dir)
            code = 0
        finally:
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    try:
        done, _, _ = select.select([pidfd], [], [], WIPE_TIMEOUT_S)
    finally:
        os.close(pidfd)
    if not done:
        _signal(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return bool(done) and status == 0


def drop_to(uid: int) -> None:
    """Become ``uid`` for good: no groups, no capabilities, no way back up."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from root to non-root: every capability set is cleared
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if os.getuid() != uid or os.geteuid() != uid:
        raise PermissionError(f"could not become uid {uid}")


def _read_all(fd: int, timeout_s: float) -> bytes:
    """What the child wrote before closing its end (or exiting), within the timeout."""
    out = b""
    try:
        while select.select([fd], [], [], timeout_s)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            out += chunk
    finally:
        os.close(fd)
    return out
