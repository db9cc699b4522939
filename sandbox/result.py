"""The outcome of one sandboxed call: `RunResult` and its `Violation` category.

A violation says which limit the code ran into; it is data about the code, never an
exception. Precedence when several apply: session_lost, processes, memory, output,
file_size, timeout (the specific resource wins over the timeout it usually causes).
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field


class Violation(enum.StrEnum):
    """Which limit a call ran into."""

    NONE = "none"
    TIMEOUT = "timeout"  # wall-clock timeout or the CPU-seconds rlimit
    MEMORY = "memory"  # address-space rlimit (MemoryError) or the OOM killer
    PROCESSES = "processes"  # process-count rlimit / pids limit (fork refused)
    OUTPUT = "output"  # stdout or stderr went past the cap; the call was killed
    FILE_SIZE = "file_size"  # a file grew past the file-size rlimit
    SESSION_LOST = "session_lost"  # the code killed the session process serving it


@dataclass(frozen=True)
class RunResult:
    """What one `run` / `run_python` call did."""

    exit_code: int | None  # None when the sandbox killed it (timeout, output); -N for signal N
    stdout: str  # captured, decoded as UTF-8 with replacement, at most the output cap
    stderr: str
    stdout_truncated: bool  # True when stdout went past the cap
    stderr_truncated: bool
    duration_s: float  # wall time of the call inside the sandbox
    violation: Violation = Violation.NONE
    files: dict[str, bytes] = field(default_factory=dict)  # collected paths, relative

    @property
    def ok(self) -> bool:
        """Exited 0 with no violation."""
        return self.exit_code == 0 and self.violation is Violation.NONE

    @classmethod
    def from_reply(cls, reply: dict) -> RunResult:
        """Build from an agent reply; KeyError/ValueError/TypeError when it is malformed."""
        violation = Violation(reply["violation"])
        return cls(
            exit_code=reply["exit_code"],
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            stdout_truncated=bool(reply["stdout_truncated"]),
            stderr_truncated=bool(reply["stderr_truncated"]),
            duration_s=float(reply["duration_s"]),
            violation=violation,
            files={k: base64.b64decode(v) for k, v in reply.get("files", {}).items()},
        )

    @classmethod
    def session_lost(cls, duration_s: float) -> RunResult:
        return cls(None, "", "", False, False, duration_s, Violation.SESSION_LOST)
