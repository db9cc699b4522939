"""The ``math`` reward: Hugging Face's math-verify decides whether the reply's final answer
equals the row's answer (``\\boxed{1/2}`` against ``0.5``, ``72`` against ``$72$``, ...).

math-verify bounds its own parsing and comparison with ``signal.alarm``, which works only in
a process's main thread, and sympy can run for ever on a reply such as ``10^{10^{10^{10}}}``.
So each check runs in a child process (``python -m envs.reward_math``: one JSON line in,
one out, in its main thread, math-verify's limits on at `LIMIT_S` each for the parses and
the comparison); a reply that trips them scores 0, as math-verify decides. The children are
a small pool, started on first use and stopped at exit; a child that dies or stops answering
(`ANSWER_S`) is killed and replaced. An answer math-verify cannot parse is the dataset's
fault, never the model's: it raises, and the episode is an infrastructure failure
(`envs.rewards`).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import subprocess
import sys
import threading
from typing import Any

from envs.rewards import reply_text

LIMIT_S = 5  # math-verify's limit on each parse and on the comparison (whole seconds)
ANSWER_S = 4 * LIMIT_S  # a child silent this long is stuck: killed, the call fails
CHILDREN = max(1, min(4, os.cpu_count() or 1))


def verify_answer(completion: str, answer: str, limit_s: int = LIMIT_S) -> float:
    """1.0 when math-verify finds `answer` in `completion`, else 0.0 (in a main thread)."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=limit_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the row's answer {answer!r}")
    predicted = parse(completion, parsing_timeout=limit_s)
    return 1.0 if verify(gold, predicted, timeout_seconds=limit_s) else 0.0


class _Child:
    """One checking process and its pipes; used by one thread at a time."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "envs.reward_math"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    def ask(self, completion: str, answer: str) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        line = json.dumps({"completion": completion, "answer": answer}) + "\n"
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_S)
        reply = self.proc.stdout.readline() if ready else b""
        if not reply:
            raise RuntimeError("the math-verify process died or stopped answering")
        result = json.loads(reply)
        if "error" in result:
            raise ValueError(result["error"])
        return float(result["reward"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class _Pool:
    """Idle children; a call takes one, and gives it back unless it broke."""

    def __init__(self) -> None:
        self.idle: queue.LifoQueue[_Child | None] = queue.LifoQueue()  # warm children first
        self.children: list[_Child] = []
        self.lock = threading.Lock()
        for _ in range(CHILDREN):
            self.idle.put(None)  # a slot: its child starts on first use

    def ask(self, completion: str, answer: str) -> float:
        child = self.idle.get()
        try:
            if child is None:
                child = _Child()
                with self.lock:
                    self.children.append(child)
            value = child.ask(completion, answer)
        except (RuntimeError, OSError):
            if child is not None:
                child.close()
                with self.lock:
                    self.children.remove(child)
            self.idle.put(None)
            raise
        except BaseException:
            self.idle.put(child)
            raise
        self.idle.put(child)
        return value

    def close(self) -> None:
        with self.lock:
            children, self.children = self.children, []
        for child in children:
            child.close()


_pool = _Pool()
atexit.register(_pool.close)


def math_reward(completion: str, answer: Any) -> float:
    """The built-in ``math`` reward (see the module docstring); runs on a reward thread."""
    if answer is None:
        raise ValueError("the row has no answer to compare with")
    return _pool.ask(reply_text(completion), str(answer))


def _serve() -> None:
    """The child: one request a line on stdin, one answer a line on stdout."""
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply: dict[str, Any] = {
                "reward": verify_answer(request["completion"], request["answer"])
            }
        except Exception as exc:  # the parent raises it: the row's answer, not the model
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
