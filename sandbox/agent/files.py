"""The file tools over a session's work dir: read, write, a string-replace edit, list.

They run in the session process, as the session's uid, so they reach exactly what the
session's own code could. Paths are relative to the work dir; leaving it is refused.
A tool's failure (a missing file, an ambiguous edit) is an ``ok: false`` reply with a
message meant for the model, never a crash of the session.
"""

from __future__ import annotations

import base64
import os

from .call import _safe_path
from .wire import _error

LIST_LIMIT = 1000  # entries in one listing


def file_request(req: dict, workdir: str, cap: int) -> dict:
    """Serve one ``file`` request (``action``: read, write, edit or list)."""
    action, rel = req.get("action"), req.get("path")
    if not isinstance(rel, str):
        return _error("'path' must be a str")
    try:
        path = workdir if rel in ("", ".") and action == "list" else _safe_path(workdir, rel)
        if action == "read":
            with open(path, "rb") as f:
                data = f.read(cap + 1)
            return {
                "ok": True,
                "data": base64.b64encode(data[:cap]).decode(),
                "truncated": len(data) > cap,
            }
        if action == "write":
            os.makedirs(os.path.dirname(path) or workdir, exist_ok=True)
            with open(path, "wb") as f:
                f.write(base64.b64decode(req["data"]))
            return {"ok": True}
        if action == "edit":
            return _edit(path, req["old"], req["new"])
        if action == "list":
            names = sorted(os.listdir(path))
            entries = [n + "/" if os.path.isdir(os.path.join(path, n)) else n for n in names]
            return {
                "ok": True,
                "entries": entries[:LIST_LIMIT],
                "truncated": len(entries) > LIST_LIMIT,
            }
        return _error(f"unknown file action {action!r}")
    except (KeyError, TypeError, ValueError) as exc:
        return _error(f"bad file request: {exc!r}")
    except OSError as exc:
        return _error(f"{action} {rel}: {exc.strerror or exc}")


def _edit(path: str, old: str, new: str) -> dict:
    if not isinstance(old, str) or not isinstance(new, str) or not old:
        return _error("'old' must be a non-empty str and 'new' a str")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    count = text.count(old)
    if count != 1:
        return _error(f"'old' occurs {count} times in {os.path.basename(path)}; it must occur once")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new, 1))
    return {"ok": True}
