"""Sandbox backends: how a sandbox running the agent is started, stopped and reaped.

A backend starts one sandbox with its host socket directory bound in and returns a
`Handle`; the pool then talks to the agent socket in that directory and never to
the backend. `BwrapBackend` jails the agent with bubblewrap (new user, pid, net, ipc,
uts and mount namespaces, read-only /usr and /dev, tmpfs work dir, agent as PID 1) in a
memory/CPU/pids cgroup of its own (cgroup v1, made under the pool's own cgroup where the
pool may), and dies with the pool. `UnsafeBackend` runs the agent as a plain host
process, with rlimits but no isolation; it exists for development and says so loudly.
The Docker backend lives in `sandbox.docker_backend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sandbox.agent.cgroups import CgroupError, Groups, missing, v1_mounts
from sandbox.agent.procs import proc_stat
from sandbox.config import SandboxConfig
from sandbox.errors import SandboxUnavailable

log = logging.getLogger(__name__)

AGENT_PACKAGE = Path(__file__).with_name("agent")  # copied into each sandbox whole


def agent_files() -> list[Path]:
    """The agent package's modules, in a stable order (the image tag hashes them)."""
    return sorted(AGENT_PACKAGE.glob("*.py"))


IN_SANDBOX_SOCKETS = "/run/agent"
IN_SANDBOX_WORK = "/work"
CGROUP_ROOT = "rollout-farm"  # under the pool's own cgroup: <root>/<owner>/<sandbox>
# sh -c: write 0 (itself) to each cgroup.procs file before "--", then exec the rest
JOIN_CGROUP = [
    "/bin/sh",
    "-c",
    'for f; do shift; [ "$f" = -- ] && break; echo 0 > "$f" || exit 111; done; exec "$@"',
    "sh",
]


@dataclass
class Handle:
    """One started sandbox, as the pool sees it."""

    name: str
    socket_dir: Path  # host directory holding agent.sock and the session sockets
    uid: int
    native: Any = field(default=None, repr=False)  # the container or the process
    lifeline: int = -1  # write end of a pipe whose closing tells the agent to exit
    cgroup: Groups | None = None  # the jail's own cgroup (bwrap), removed with it
    missing: dict[str, str] = field(default_factory=dict)  # bounds not made, and why


class Backend(Protocol):
    async def prepare(self) -> None: ...
    async def start(self, name: str, uid: int, socket_dir: Path) -> Handle: ...
    async def alive(self, handle: Handle) -> bool: ...
    async def stop(self, handle: Handle) -> None: ...
    async def close(self) -> None: ...


def owner_token() -> str:
    """host:pid:starttime of this process; survives pid reuse."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def owner_alive(token: str) -> bool:
    """False only when the token names a process on this host that is gone."""
    host, _, rest = token.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # not ours to judge: another host's pool may still use it
    return _start_time(int(pid)) == start


def _start_time(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return stat[stat.rindex(b")") + 2 :].split()[19].decode()


def reap_socket_dirs(root: Path) -> int:
    """Remove pool directories under ``root`` whose owner process is gone."""
    removed = 0
    if not root.is_dir():
        return 0
    for pool_dir in root.iterdir():
        owner = pool_dir / "owner"
        try:
            token = owner.read_text().strip()
        except OSError:
            continue
        if not owner_alive(token):
            shutil.rmtree(pool_dir, ignore_errors=True)
            removed += 1
    return removed


def _owner_dir() -> str:
    """This pool process's directory name under `CGROUP_ROOT`: pid and start time."""
    return f"{os.getpid()}-{_start_time(os.getpid())}"


def reap_cgroups() -> int:
    """Remove the jail cgroups of pool processes that are gone (their jails are dead:
    `reap_orphan_jails`); returns how many owner directories went."""
    mounts = v1_mounts()
    if missing(mounts):
        return 0
    removed = 0
    for ctrl in ("memory", "cpu", "pids"):
        root = Path(Groups.under_self(mounts, CGROUP_ROOT).dirs[ctrl])
        if not root.is_dir():
            continue
        for owner in root.iterdir():
            pid, _, start = owner.name.partition("-")
            if not pid.isdigit() or _start_time(int(pid)) == start:
                continue
            jails = [p for p in owner.iterdir() if p.is_dir()]
            if all(Groups({ctrl: str(j)}).remove(0) for j in jails) and Groups(
                {ctrl: str(owner)}
            ).remove(0):
                removed += 1
    return removed


def reap_orphan_jails(root: Path) -> int:
    """Kill bwrap processes orphaned (parent PID 1) whose socket dir is under ``root``
    in a pool directory that is gone or whose owner is dead."""
    killed = 0
    prefix = str(root).rstrip("/") + "/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not args[0].endswith(b"bwrap"):
            continue
        fields = proc_stat(entry.name)
        if fields is None or fields[1] != b"1":  # gone, or not orphaned
            continue
        binds = [
            args[i + 1].decode(errors="replace") for i, a in enumerate(args[:-1]) if a == b"--bind"
        ]
        for bound in binds:
            if not bound.startswith(prefix):
                continue
            owner = Path(bound).parent / "owner"
            try:
                alive = owner_alive(owner.read_text().strip())
            except OSError:
                alive = False
            if not alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed += 1
    return killed


class _ProcessBackend:
    """Shared by bwrap and unsafe: the sandbox is one child process of the pool."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config

    def argv(self, uid: int, socket_dir: Path) -> list[str]:
        raise NotImplementedError

    def cgroup(self, name: str) -> tuple[Groups | None, dict[str, str]]:
        """The sandbox's own cgroup, made; or None and why it could not be."""
        return None, {}

    async def start(self, name: str, uid: int, socket_dir: Path) -> Handle:
        await asyncio.to_thread(self._prepare_dirs, uid, socket_dir)
        group, problems = await asyncio.to_thread(self.cgroup, name)
        # the sandbox's first process joins its cgroup before it execs anything, so
        # everything it starts is in there (uvloop takes no preexec_fn)
        join = [] if group is None else [*JOIN_CGROUP, *group.procs_files(), "--"]
        # As root, drop to the sandbox's own host uid before exec: RLIMIT_NPROC does not
        # bind root (a fork bomb would reach the whole host), and a distinct uid per
        # sandbox keeps process counts and signals apart.
        # setpriv (util-linux) switches credentials in the child rather than the loop's
        # subprocess kwargs, which uvloop (the workers' default loop) does not take.
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        prefix = drop if os.geteuid() == 0 else []
        log_path = socket_dir.with_suffix(".log")
        # bwrap's --die-with-parent is lost when it switches credentials, so the agent
        # also watches this pipe: when the pool process dies, the pipe closes
        life_r, life_w = os.pipe()
        try:
            with open(log_path, "wb") as log_file:  # noqa: ASYNC230 (local file, instant)
                proc = await asyncio.create_subprocess_exec(
                    *join,
                    *prefix,
                    *self.argv(uid, socket_dir),
                    "--lifeline-fd",
                    str(life_r),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log_file,
                    start_new_session=True,
                    pass_fds=(life_r,),
                )
        except BaseException:
            os.close(life_w)
            if group is not None:
                await asyncio.to_thread(group.remove)
            raise
        finally:
            os.close(life_r)
        return Handle(name, socket_dir, uid, proc, life_w, group, problems)

    def _prepare_dirs(self, uid: int, socket_dir: Path) -> None:
        """The sandbox uid must reach its socket dir and read the agent."""
        pool_dir = socket_dir.parent
        pool_dir.chmod(0o711)
        lib = pool_dir / "lib"  # listable (the import system lists it), unlike pool_dir
        if not (lib / "agent").exists():
            # copied aside, then renamed in at once: concurrent starts never see half
            staging = Path(tempfile.mkdtemp(dir=pool_dir))
            for source in agent_files():
                shutil.copyfile(source, staging / source.name)
                (staging / source.name).chmod(0o644)
            staging.chmod(0o755)
            lib.mkdir(mode=0o755, exist_ok=True)
            try:
                staging.rename(lib / "agent")
            except OSError:  # another start got there first
                shutil.rmtree(staging, ignore_errors=True)
        if os.geteuid() == 0:
            os.chown(socket_dir, uid, uid)

    async def alive(self, handle: Handle) -> bool:
        return handle.native.returncode is None

    async def stop(self, handle: Handle) -> None:
        proc: asyncio.subprocess.Process | None = handle.native
        if handle.lifeline >= 0:
            os.close(handle.lifeline)
            handle.lifeline = -1
        if proc is not None:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        if handle.cgroup is not None and not await asyncio.to_thread(handle.cgroup.remove):
            log.warning("cgroup of sandbox %s is still busy; left in place", handle.name)
        shutil.rmtree(handle.socket_dir, ignore_errors=True)
        handle.socket_dir.with_suffix(".log").unlink(missing_ok=True)

    async def close(self) -> None:
        return None


class BwrapBackend(_ProcessBackend):
    """bubblewrap: no engine needed; the jail dies with the pool process."""

    async def prepare(self) -> None:
        if shutil.which("bwrap") is None:
            raise SandboxUnavailable("bwrap is not installed (apt-get install bubblewrap)")
        killed = await asyncio.to_thread(reap_orphan_jails, self.config.socket_dir)
        if killed:
            log.warning("killed %d bwrap jails left by dead sandbox pools", killed)
        await asyncio.to_thread(reap_cgroups)

    def cgroup(self, name: str) -> tuple[Groups | None, dict[str, str]]:
        """One cgroup per jail (which holds one session): its memory, CPU and pids."""
        mounts = v1_mounts()
        why = missing(mounts)
        if why:
            return None, {"cgroups": why}
        group = Groups.under_self(mounts, f"{CGROUP_ROOT}/{_owner_dir()}/{name}")
        memory_mb, _ = self.config.memory_plan()
        try:
            group.make(memory_mb << 20, self.config.cpus, self.config.pids)
        except CgroupError as exc:
            group.remove(0)
            return None, {"cgroups": str(exc)}
        return group, {}

    async def close(self) -> None:
        """Remove this process's cgroup directory once its last jail's is gone (another
        pool of this process may still use it: then it stays)."""
        mounts = v1_mounts()
        if not missing(mounts):
            await asyncio.to_thread(
                Groups.under_self(mounts, f"{CGROUP_ROOT}/{_owner_dir()}").remove, 0
            )

    def argv(self, uid: int, socket_dir: Path) -> list[str]:
        cfg = self.config
        args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1"]
        args += ["--uid", str(uid), "--gid", str(uid), "--cap-drop", "ALL"]
        args += ["--ro-bind", "/usr", "/usr"]
        for link, target in (("/bin", "usr/bin"), ("/sbin", "usr/sbin"), ("/lib", "usr/lib")):
            args += ["--symlink", target, link]
        if Path("/usr/lib64").exists():
            args += ["--symlink", "usr/lib64", "/lib64"]
        if Path("/etc/ld.so.cache").exists():
            args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        # /dev and /tmp read-only: each session mounts its own /tmp, /dev/shm, /dev/pts
        args += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--dir", "/tmp"]
        args += ["--size", str(cfg.work_mb << 20), "--tmpfs", IN_SANDBOX_WORK]
        args += ["--bind", str(socket_dir), IN_SANDBOX_SOCKETS]
        args += ["--ro-bind", str(socket_dir.parent / "lib" / "agent"), "/opt/agent/agent"]
        args += ["--remount-ro", "/"]
        args += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--chdir", IN_SANDBOX_WORK]
        args += ["/usr/bin/python3", "-I", "-S", "/opt/agent/agent"]
        args += ["--socket-dir", IN_SANDBOX_SOCKETS, "--work-dir", IN_SANDBOX_WORK]
        args += ["--private-sessions", "--session-ptys", str(cfg.session_ptys)]
        return args


class UnsafeBackend(_ProcessBackend):
    """No isolation at all: the agent runs as this host user. Development only."""

    async def prepare(self) -> None:
        log.warning(
            "SANDBOX BACKEND unsafe-no-isolation: NO ISOLATION AT ALL. Untrusted code runs "
            "on this host with rlimits only (as a throw-away uid when started as root, else "
            "as uid %d), and sessions sharing a sandbox can read, overwrite and kill each "
            "other; never use it for model-generated code in production",
            os.getuid(),
        )

    def argv(self, uid: int, socket_dir: Path) -> list[str]:
        work = socket_dir.with_name(socket_dir.name + "-work")
        python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
        return [
            python,
            "-I",
            str(socket_dir.parent / "lib" / "agent"),
            "--socket-dir",
            str(socket_dir),
            "--work-dir",
            str(work),
        ]

    def _prepare_dirs(self, uid: int, socket_dir: Path) -> None:
        super()._prepare_dirs(uid, socket_dir)
        work = socket_dir.with_name(socket_dir.name + "-work")
        work.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            os.chown(work, uid, uid)

    async def stop(self, handle: Handle) -> None:
        await super().stop(handle)
        work = handle.socket_dir.with_name(handle.socket_dir.name + "-work")
        shutil.rmtree(work, ignore_errors=True)
