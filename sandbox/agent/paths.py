"""Paths in a session's directories, opened without following links; the wipe of a slot.

The session process opens work-dir paths on the model's behalf (the file tools, a
call's ``files`` and ``collect``, the shell's command files), and it can reach more
than the code it serves: its own sockets and its spare processes' pipes through
``/proc/self/fd``. So a path is resolved one component at a time under a directory
descriptor with ``O_NOFOLLOW``: a symbolic link anywhere on it is refused, and so is
anything but a regular file (a FIFO would block the session, a device never ends).
`empty` removes a tree whatever the code did to it (modes, depth, links), without
recursion. Stdlib only.
"""

from __future__ import annotations

import errno
import os
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO never blocks


def open_dir(root: str, parts: list[str], create: bool = False) -> int:
    """A descriptor of ``root``/``parts``, no link followed (``create``: make what is missing)."""
    fd = os.open(root, DIR_FLAGS)
    try:
        for part in parts:
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o700, dir_fd=fd)
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _explain(exc, part) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(root: str, rel: str, flags: int, create_parents: bool = False) -> int:
    """Open the regular file ``root``/``rel`` (``rel`` already checked to stay inside)."""
    *parents, name = rel.split("/")
    parent = open_dir(root, parents, create=create_parents)
    try:
        fd = os.open(name, flags | FILE_FLAGS, 0o600, dir_fd=parent)
    except OSError as exc:
        raise _explain(exc, name) from None
    finally:
        os.close(parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file (devices, FIFOs and sockets are refused)")
    os.set_blocking(fd, True)
    return fd


def read_capped(fd: int, cap: int) -> bytes:
    """Up to ``cap + 1`` bytes of ``fd``: one more than the cap says there was more."""
    chunks, left = [], cap + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def own_dir(parent: int, name: str) -> int:
    """An O_PATH descriptor of the real directory ``name`` under ``parent``, made if
    missing, with its owner's modes given back; a link or file that the code put there
    instead is removed first."""
    for _ in range(3):
        try:
            fd = os.open(
                name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
            )
        except FileNotFoundError:
            pass
        except OSError:  # a link, a file, a FIFO: not ours, and not followed
            os.unlink(name, dir_fd=parent)
        else:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.chmod(f"/proc/self/fd/{fd}", 0o700)  # the descriptor, not a path: no link
                return fd
            os.close(fd)
            os.unlink(name, dir_fd=parent)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"{name} could not be made a directory")


def empty(path: str) -> None:
    """Remove everything under the directory ``path`` (kept: it may be a mount point).

    Run by a process of the tree's owner once none of its processes is left, so nothing
    changes the tree meanwhile: each directory is given back the mode that lets its
    owner empty it, and the walk goes down by ``chdir`` one level at a time, so any
    depth works (no recursion, no path longer than a name).
    """
    os.chmod(path, 0o700)
    os.chdir(path)
    below: list[str] = []  # the directories gone down into, outermost first
    while True:
        sub = _unlink_files(".")
        if sub is not None:
            os.chmod(sub, 0o700)
            os.chdir(sub)
            below.append(sub)
            continue
        if not below:
            return
        os.chdir("..")
        os.rmdir(below.pop())


def _unlink_files(directory: str) -> str | None:
    """Unlink every non-directory in ``directory``; the name of a subdirectory, if any."""
    sub = None
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                sub = sub or entry.name
            else:
                os.unlink(entry.name)
    return sub


def _explain(exc: OSError, name: str) -> OSError:
    if exc.errno == errno.ELOOP:
        return OSError(exc.errno, f"{name} is a symbolic link (links are not followed)")
    if exc.errno == errno.ENOTDIR:
        return OSError(exc.errno, f"{name} is not a directory (links are not followed)")
    return exc
