"""One request to the in-sandbox CodeGym runtime, and how its reply is judged.

``run_request`` ships the request (and the committed state snapshot) into the
session, runs the runtime under the tool time limit and reads ``response.json``
back. The reply counts only if the process finished within its limits and the
reply carries this request's nonce; otherwise the outcome is ``rolled_back``
and the caller keeps its snapshot — that is the transaction.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from envs.sandboxed import PythonSession, violated, violation_name

BOOTSTRAP = "import os, sys\nsys.path.insert(0, os.getcwd())\nimport codegym_runtime\ncodegym_runtime.main()\n"


@dataclass(frozen=True)
class Reply:
    """What one runtime request produced."""

    ok: bool  # finished in time with a well-formed reply
    data: dict[str, Any]  # the reply (empty unless ok)
    problem: str = ""  # why it did not count (shown to the agent or the loader)


async def run_request(
    sb: PythonSession,
    request: dict[str, Any],
    *,
    state: str | None,
    limit_s: float,
    files: dict[str, str] | None = None,
) -> Reply:
    """Run one runtime request in session ``sb``; never raises for what the code did."""
    nonce = secrets.token_hex(12)
    payload = {**(files or {}), "request.json": json.dumps({**request, "nonce": nonce})}
    if state is not None:
        payload["state.json"] = state
    result = await sb.run_python(
        BOOTSTRAP, files=payload, timeout=limit_s, collect=["response.json"]
    )
    if violated(result):
        return Reply(False, {}, f"exceeded its {violation_name(result)} limit")
    raw = (getattr(result, "files", None) or {}).get("response.json")
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or data.get("nonce") != nonce:
        detail = (result.stderr or "").strip()[-300:]
        return Reply(
            False, {}, f"ended without a reply (exit code {result.exit_code}) {detail}".strip()
        )
    if "env_error" in data:
        return Reply(False, {}, f"environment code failed: {str(data['env_error'])[-600:]}")
    return Reply(True, data)
