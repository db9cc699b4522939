"""The ``terminal`` environment: a task in a sandbox, a persistent shell, a check for reward.

A `TerminalTask` carries a prompt, a setup script and a check script (bash). At reset
the episode opens one sandbox session and runs the setup in its persistent shell; the
model then works with the tools ``shell``, ``read_file``, ``write_file``, ``edit_file``
and ``list_dir`` (OpenAI tool schemas, from `ToolEnv`), and calls ``submit`` when done.
The check runs in the same session, as a fresh process beside the shell's background
jobs (so a server the model started is reachable on the loopback): reward 1.0 when it
exits 0, else 0.0. Every session has a loopback of its own (its own network namespace),
so the tasks' fixed ports never collide between episodes sharing a sandbox, and a check
reaches only its own episode's server. The session, with every background job, ends with the episode.
Sandbox failures become ``EnvInfraError(category=SANDBOX)``, never the model's fault.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from broker.messages import ErrorCategory
from envs.api import ResetResult
from envs.errors import EnvInfraError, EnvSpecError, EnvStateError
from envs.sandboxed import SandboxPool, SandboxSession, require_pool
from envs.toolenv import ToolEnv
from envs.tools import tool

SHELL_TIMEOUT_S = 30.0  # per shell call; a server must be started with `&`
CHECK_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class TerminalTask:
    """One terminal task."""

    name: str
    prompt: str  # what the model is asked to do
    setup: str  # bash, run in the session's shell before the first turn
    check: str  # bash, run after submit: exit 0 means solved


def _http_check(url: str, expected: bytes) -> str:
    """A check script: GET `url` until something answers (for 5 s: on a loaded host a server
    started in the background listens late), then compare the body."""
    return f"""python3 - <<'PY'
import time, urllib.request
for _ in range(25):
    try:
        body = urllib.request.urlopen({url!r}, timeout=5).read()
        break
    except OSError:
        time.sleep(0.2)
else:
    raise SystemExit("nothing answered at {url}")
assert body == {expected!r}, body
PY"""


SERVE_FILE = TerminalTask(
    name="serve-file",
    prompt=(
        "Start an HTTP server in the background that serves the work directory on "
        "127.0.0.1 port 8000, so that GET /hello.txt returns its contents. "
        "Then call submit."
    ),
    setup="printf 'hello from the sandbox\\n' > hello.txt",
    check=_http_check("http://127.0.0.1:8000/hello.txt", b"hello from the sandbox\n"),
)

FIX_AND_SERVE = TerminalTask(
    name="fix-and-serve",
    prompt=(
        "app.py is a small HTTP service whose /health answer must be the text ok, "
        "but it has a bug. Fix it, start it in the background on port 8001 "
        "(python3 app.py 8001), and call submit."
    ),
    setup="""cat > app.py <<'PY'
import http.server, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ko" if self.path == "/health" else b"?"
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
PY""",
    check=_http_check("http://127.0.0.1:8001/health", b"ok"),
)

KEEP_TICKING = TerminalTask(
    name="keep-ticking",
    prompt=(
        "ticker.sh appends a line to ticks.log every 0.2 s. Start it so that it keeps "
        "running after your command returns, then call submit."
    ),
    setup="printf 'while :; do date +%%s%%N >> ticks.log; sleep 0.2; done\\n' > ticker.sh",
    # 3 new lines within 5 s, not within 1 s: on a loaded host the ticker's 0.2 s sleeps run
    # late (its first may not be written yet), and a fixed 1 s window scored a running ticker 0
    check=(
        "n() { cat ticks.log 2>/dev/null | wc -l; }; a=$(n); for _ in $(seq 25); do "
        "sleep 0.2; [ $(($(n) - a)) -ge 3 ] && exit 0; done; exit 1"
    ),
)

TASKS: dict[str, TerminalTask] = {t.name: t for t in (SERVE_FILE, FIX_AND_SERVE, KEEP_TICKING)}


class TerminalEnv(ToolEnv):
    """One task per episode in its own sandbox session with a persistent shell."""

    def __init__(self, pool: SandboxPool, tasks: list[TerminalTask]) -> None:
        super().__init__()
        self.pool, self.tasks = pool, tasks
        self.task: TerminalTask | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._sb: SandboxSession | None = None

    async def setup(self, seed: int | None) -> ResetResult:
        await self.aclose()
        self.task = self.tasks[(seed or 0) % len(self.tasks)]
        self._stack = contextlib.AsyncExitStack()
        self._sb = await self._sandboxed(self._stack.enter_async_context(self.pool.session()))
        r = await self._sandboxed(self._sb.shell(self.task.setup, timeout=SHELL_TIMEOUT_S))
        if not r.ok:  # the task's own script failed: not the model's doing
            raise EnvInfraError(f"setup of {self.task.name} failed: {r}", ErrorCategory.SANDBOX)
        return self.task.prompt, {"task": self.task.name}

    @property
    def _session(self) -> SandboxSession:
        if self._sb is None:
            raise EnvStateError("terminal: tool call before reset() or after the episode ended")
        return self._sb

    async def aclose(self) -> None:
        """End the session: the work dir and every background job go with it."""
        stack, self._stack, self._sb = self._stack, None, None
        if stack is not None:
            await self._sandboxed(stack.aclose())

    @tool
    async def shell(self, command: str) -> str:
        """Run a bash command in your persistent shell (cwd, variables and background
        jobs started with & are kept between calls).

        Args:
            command: the bash command line.
        """
        r = await self._sandboxed(self._session.shell(command, timeout=SHELL_TIMEOUT_S))
        status = "timed out" if r.exit_code is None else f"exit {r.exit_code}"
        cut = " [output truncated]" if r.stdout_truncated else ""
        return f"{r.stdout}{cut}\n[{status}]"

    @tool
    async def read_file(self, path: str) -> str:
        """Read a file of the work directory.

        Args:
            path: path relative to the work directory.
        """
        try:
            data = await self._sandboxed(self._session.read_file(path))
        except _tool_errors() as exc:
            return f"Error: {exc}"
        return data.decode("utf-8", errors="replace")

    @tool
    async def write_file(self, path: str, content: str) -> str:
        """Create or replace a file of the work directory.

        Args:
            path: path relative to the work directory.
            content: the whole new contents.
        """
        try:
            await self._sandboxed(self._session.write_file(path, content))
        except _tool_errors() as exc:
            return f"Error: {exc}"
        return f"wrote {path}"

    @tool
    async def edit_file(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of `old` in a file with `new`.

        Args:
            path: path relative to the work directory.
            old: text that occurs exactly once in the file.
            new: its replacement.
        """
        try:
            await self._sandboxed(self._session.edit_file(path, old, new))
        except _tool_errors() as exc:
            return f"Error: {exc}"
        return f"edited {path}"

    @tool
    async def list_dir(self, path: str = ".") -> str:
        """List a directory of the work directory (directories end in /).

        Args:
            path: path relative to the work directory.
        """
        try:
            return "\n".join(await self._sandboxed(self._session.list_dir(path)))
        except _tool_errors() as exc:
            return f"Error: {exc}"

    @tool
    async def submit(self) -> str:
        """Say the task is done: the check runs and the episode ends."""
        if self.task is None:
            raise EnvInfraError("submit before reset", ErrorCategory.SANDBOX)
        check = self._session.run(["bash", "-c", self.task.check], timeout=CHECK_TIMEOUT_S)
        r = await self._sandboxed(check)
        self.end_episode(1.0 if r.exit_code == 0 else 0.0)
        return "solved" if r.exit_code == 0 else "not solved"

    @staticmethod
    async def _sandboxed(awaitable: Any) -> Any:
        from sandbox import SandboxError  # lazily: `import envs` must not need the sandbox

        try:
            return await awaitable
        except SandboxError as exc:
            raise EnvInfraError(f"sandbox failed: {exc}", ErrorCategory.SANDBOX) from exc


def _tool_errors() -> tuple[type[Exception], ...]:
    """A file tool's failures that are the model's mistake: shown as the tool's answer."""
    from sandbox import FileToolError

    return (FileToolError, ValueError, TypeError)


def make_terminal_env(
    tasks: list[str] | None = None, sandbox: SandboxPool | None = None
) -> TerminalEnv:
    """``terminal@{"tasks": ["serve-file", ...]}``; all built-in tasks by default."""
    names = list(TASKS) if tasks is None else tasks
    unknown = [n for n in names if n not in TASKS]
    if not names or unknown:
        raise EnvSpecError(f"terminal: unknown tasks {unknown or names}; known: {sorted(TASKS)}")
    return TerminalEnv(require_pool(sandbox, "terminal"), [TASKS[n] for n in names])
