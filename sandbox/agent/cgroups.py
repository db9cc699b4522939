"""Memory, CPU and process cgroups of sessions (cgroup v1), for a bound per session.

A session's processes, the files it keeps on tmpfs and its shared memory are all charged
to its memory cgroup, so its `memory` limit bounds them together and a neighbour's
allocation within its own share succeeds. Sibling CPU cgroups get equal shares, so
busy sessions split the sandbox's CPU evenly whatever each runs in the background.

Used on both sides: the agent in a container makes one group per session slot under
the container's own cgroup (`Groups.under_mounts`, after remounting those mounts
writable), and the pool on the host makes one group per bubblewrap jail under its own
cgroup (`Groups.under_self`). Only cgroup v1 is handled: on a cgroup v2 host `find`
reports that the bound cannot be made. Stdlib only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

CONTROLLERS = ("memory", "cpu", "pids")
CFS_PERIOD_US = 100_000


class CgroupError(OSError):
    """A cgroup could not be made, limited, joined or removed."""


def v1_mounts(mountinfo: str = "/proc/self/mountinfo") -> dict[str, str]:
    """Mount point of each cgroup v1 hierarchy this process sees, by controller."""
    found: dict[str, str] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = [*right.split(), "", "", ""][:3]
            if fstype != "cgroup":
                continue
            for ctrl in options.split(","):
                if ctrl in CONTROLLERS and ctrl not in found:
                    found[ctrl] = left.split()[4]
    return found


def missing(mounts: dict[str, str]) -> str:
    """Why these mounts cannot hold session cgroups, or '' when they can."""
    lacking = [c for c in CONTROLLERS if c not in mounts]
    if not lacking:
        return ""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "cgroup v2 is not supported (only cgroup v1 hierarchies are handled)"
    return f"no cgroup v1 hierarchy for {', '.join(lacking)}"


@dataclass(frozen=True)
class Groups:
    """One cgroup in each controller's hierarchy: controller -> directory."""

    dirs: dict[str, str]

    @classmethod
    def under_mounts(cls, mounts: dict[str, str], name: str) -> Groups:
        """``name`` right under each hierarchy's mount point (a container's own cgroup)."""
        return cls({c: os.path.join(mounts[c], name) for c in CONTROLLERS})

    @classmethod
    def under_self(cls, mounts: dict[str, str], name: str) -> Groups:
        """``name`` under this process's own cgroup in each hierarchy (the host side)."""
        own: dict[str, str] = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for ctrl in ctrls.split(","):
                    own[ctrl] = path
        return cls(
            {c: os.path.join(mounts[c], own.get(c, "/").lstrip("/"), name) for c in CONTROLLERS}
        )

    def make(self, memory_bytes: int = 0, cpus: float = 0.0, pids: int = 0) -> None:
        """Create the groups with the given limits (0: none of that kind)."""
        try:
            for path in self.dirs.values():
                os.makedirs(path, exist_ok=True)
            if memory_bytes:
                self._write("memory", "memory.limit_in_bytes", memory_bytes)
                # without swap accounting this file is absent; with it, swap adds nothing
                if os.path.exists(os.path.join(self.dirs["memory"], "memory.memsw.limit_in_bytes")):
                    self._write("memory", "memory.memsw.limit_in_bytes", memory_bytes)
            if cpus:
                self._write("cpu", "cpu.cfs_period_us", CFS_PERIOD_US)
                self._write("cpu", "cpu.cfs_quota_us", int(cpus * CFS_PERIOD_US))
            if pids:
                self._write("pids", "pids.max", pids)
        except OSError as exc:
            raise CgroupError(exc.errno, f"cgroup {self.dirs}: {exc}") from None

    def join(self, pid: int = 0) -> None:
        """Move ``pid`` (0: the caller) into every group; its children follow it."""
        try:
            for ctrl in CONTROLLERS:
                self._write(ctrl, "cgroup.procs", pid)
        except OSError as exc:
            raise CgroupError(exc.errno, f"cannot join {self.dirs}: {exc}") from None

    def procs_files(self) -> list[str]:
        return [os.path.join(self.dirs[c], "cgroup.procs") for c in CONTROLLERS]

    def remove(self, wait_s: float = 2.0) -> bool:
        """Remove the groups once their processes are gone; False if some stayed."""
        deadline = time.monotonic() + wait_s
        left = [p for p in self.dirs.values() if os.path.isdir(p)]
        while left:
            for path in list(left):
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue  # EBUSY: its last processes are still exiting
                left.remove(path)
            if left:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True

    def _write(self, ctrl: str, name: str, value: int) -> None:
        with open(os.path.join(self.dirs[ctrl], name), "w") as f:
            f.write(str(value))
