"""The file tools over a session's work dir: read, write, a string-replace edit, list.

They run in the session process, which can reach more than the session's code (its
sockets, its spare processes' pipes), so every path is opened without following a
link (`.paths`), and only regular files are read or written: a link, a FIFO or a device
the code planted is refused. Reading and editing are capped at ``cap`` bytes (the
collect cap), so a huge file costs the session process no more than that. Paths are
relative to the work dir; leaving it is refused. A tool's failure (a missing file, an
ambiguous edit, a file too big) is an ``ok: false`` reply with a message meant for the
model, never a crash of the session.
"""

from __future__ import annotations

import base64
import os
import stat

from .call import _safe_path
from .paths import WRITE_FLAGS, open_dir, open_file, read_capped
from .wire import _error

LIST_LIMIT = 1000  # entries in one listing


def file_request(req: dict, workdir: str, cap: int) -> dict:
    """Serve one ``file`` request (``action``: read, write, edit or list)."""
    action, rel = req.get("action"), req.get("path")
    if not isinstance(rel, str):
        return _error("'path' must be a str")
    try:
        if action == "list" and rel in ("", "."):
            return _list(workdir, [])
        _safe_path(workdir, rel)
        rel = os.path.normpath(rel)
        if action == "read":
            data = _read(workdir, rel, cap)
            return {
                "ok": True,
                "data": base64.b64encode(data[:cap]).decode(),
                "truncated": len(data) > cap,
            }
        if action == "write":
            data = base64.b64decode(req["data"])
            fd = open_file(workdir, rel, WRITE_FLAGS, create_parents=True)
            with open(fd, "wb") as f:
                f.write(data)
            return {"ok": True}
        if action == "edit":
            return _edit(workdir, rel, req["old"], req["new"], cap)
        if action == "list":
            return _list(workdir, rel.split("/"))
        return _error(f"unknown file action {action!r}")
    except (KeyError, TypeError, ValueError) as exc:
        return _error(f"bad file request: {exc!r}")
    except OSError as exc:
        return _error(f"{action} {rel}: {exc.strerror or exc}")


def _read(workdir: str, rel: str, cap: int) -> bytes:
    fd = open_file(workdir, rel, os.O_RDONLY)
    try:
        return read_capped(fd, cap)
    finally:
        os.close(fd)


def _edit(workdir: str, rel: str, old: str, new: str, cap: int) -> dict:
    if not isinstance(old, str) or not isinstance(new, str) or not old:
        return _error("'old' must be a non-empty str and 'new' a str")
    raw = _read(workdir, rel, cap)
    if len(raw) > cap:
        return _error(f"{rel} is larger than {cap} bytes, the most edit_file reads")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return _error(f"{rel} is not UTF-8 text")
    count = text.count(old)
    if count != 1:
        return _error(f"'old' occurs {count} times in {os.path.basename(rel)}; it must occur once")
    fd = open_file(workdir, rel, WRITE_FLAGS)
    with open(fd, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, 1))
    return {"ok": True}


def _list(workdir: str, parts: list[str]) -> dict:
    fd = open_dir(workdir, parts)
    try:
        names = sorted(os.listdir(fd))
        entries = []
        for name in names[: LIST_LIMIT + 1]:
            try:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except OSError:
                continue  # gone since the listing
            entries.append(name + "/" if stat.S_ISDIR(mode) else name)
    finally:
        os.close(fd)
    return {"ok": True, "entries": entries[:LIST_LIMIT], "truncated": len(names) > LIST_LIMIT}
