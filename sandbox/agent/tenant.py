"""A session's own namespaces: what makes a session a tenant of its sandbox.

Before it serves anything, a session process (already its own uid where the sandbox
gives each session one) enters a new user namespace that it owns, and with it new
mount, IPC and network namespaces:

- IPC: its SysV objects and POSIX message queues are its own and die with it;
- network: its own loopback, brought up, so a port is private to one episode;
- mount: ``/tmp`` and ``/dev/shm`` are directories of its own slot (sized with the slot's
  disk, charged to its memory, wiped with it), ``/dev/pts`` is a devpts instance of its
  own holding at most ``ptys`` terminals, ``/dev/mqueue`` its own, ``/run`` (the agent's
  sockets) and ``/sys/fs/cgroup`` are covered by empty read-only tmpfs, and the work
  root is read-only but for its slot.

Then it drops every capability it held in that namespace. The kernel locks the mounts
made here for any namespace the code creates below, so it cannot uncover what they hide.
Stdlib only (ctypes for the system calls Python does not wrap).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct

from .paths import own_dir
from .procs import _LIBC

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# a remount must keep a mount's flags that the kernel locked (statvfs flag -> mount flag)
_KEPT = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
CAP_SYS_ADMIN = 21
_CAP_V3 = 0x20080522
HIDDEN = ("/run", "/sys/fs/cgroup")  # the agent's sockets; every slot's cgroup


def enter(slot_dir: str, work_root: str, ptys: int) -> None:
    """Give the calling process (the new session) its own namespaces; see module doc."""
    uid, gid = os.geteuid(), os.getegid()
    _call(_libc().unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET), "unshare")
    _map_ids(uid, gid)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    slot = os.open(slot_dir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name, target in (("tmp", "/tmp"), ("shm", "/dev/shm")):
            fd = own_dir(slot, name)
            try:
                _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
            finally:
                os.close(fd)
        # the slot as a mount of its own, so that the work root around it goes read-only
        _mount(f"/proc/self/fd/{slot}", slot_dir, None, MS_BIND)
    finally:
        os.close(slot)
    remount(work_root, read_only=True)
    pts = f"newinstance,ptmxmode=0666,mode=0620,max={ptys}"
    _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, pts)
    if os.path.isdir("/dev/mqueue"):
        _mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in HIDDEN:
        if os.path.isdir(path):
            _cover(path)
    _loopback_up()
    set_caps(0)


def probe() -> None:
    """What `enter` needs of the kernel, tried in the calling (throw-away) process:
    raises OSError naming the step that the sandbox refuses."""
    uid, gid = os.geteuid(), os.getegid()
    _call(_libc().unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET), "unshare")
    _map_ids(uid, gid)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _cover("/run")
    _mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,max=1")
    _loopback_up()


def remount(path: str, read_only: bool) -> None:
    """Remount ``path`` (a mount point) read-only or writable, keeping its locked flags."""
    flags = os.statvfs(path).f_flag
    keep = sum(ms for st, ms in _KEPT if flags & st)
    _mount(None, path, None, MS_REMOUNT | MS_BIND | keep | (MS_RDONLY if read_only else 0))


def set_caps(keep: int) -> None:
    """Keep only the capabilities in the ``keep`` mask (bits by capability number) in the
    effective and permitted sets; the inheritable set is emptied. Never raises them."""
    header = _CapHeader(_CAP_V3, 0)
    data = (_CapData * 2)()
    _call(_libc().capget(ctypes.byref(header), data), "capget")
    for word, item in enumerate(data):
        mask = (keep >> (32 * word)) & 0xFFFFFFFF
        item.effective &= mask
        item.permitted &= mask
        item.inheritable = 0
    _call(_libc().capset(ctypes.byref(header), data), "capset")


def capabilities() -> int:
    """The effective capability mask of the caller."""
    header = _CapHeader(_CAP_V3, 0)
    data = (_CapData * 2)()
    _call(_libc().capget(ctypes.byref(header), data), "capget")
    return data[0].effective | (data[1].effective << 32)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _map_ids(uid: int, gid: int) -> None:
    """Map our one uid and gid to themselves: files keep their owners' numbers."""
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")  # an unprivileged gid map needs setgroups denied
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _cover(path: str) -> None:
    _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    result = _libc().mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])
    _call(result, f"mount {target}")


def _libc():
    if _LIBC is None:
        raise OSError(errno.ENOSYS, "ctypes is unavailable: no system calls for namespaces")
    return _LIBC


def _call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
