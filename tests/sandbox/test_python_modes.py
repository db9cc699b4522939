"""`run_python` in both modes: the persistent per-session interpreter keeps calls apart
(fresh namespace, fresh imports, nothing left running), and the fork mode contains the
same hostile code as the default mode does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sandbox import Violation
from tests.sandbox.test_hostile import LIST_PROCS

Factory = Callable[..., Any]


async def test_persistent_interpreter_keeps_calls_apart(pool_factory: Factory) -> None:
    pool = await pool_factory(python_mode="persistent")
    async with pool.session() as s:
        first = await s.run_python("x = 1\nimport os\nprint(os.getpid())")
        again = await s.run_python("import os\nprint(os.getpid(), 'x' in globals())")
        pid, leaked = again.stdout.split()
        assert pid == first.stdout.strip() and leaked == "False"  # one process, no globals
        await s.run_python("import helper", files={"helper.py": "V = 1"})
        edited = await s.run_python("import helper; print(helper.V)", files={"helper.py": "V = 2"})
        assert edited.stdout == "2\n"  # edited modules are imported afresh
        await s.run_python(
            "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()"
        )
        after = await s.run_python("import os\nprint(os.getpid())")
        assert after.stdout.strip() != pid  # a call that left a thread gets a new worker
        forks = await s.run_python(
            "import os, sys\nfor _ in range(3):\n    if os.fork() == 0:\n        sys.exit(0)\n"
            "print('parent')"
        )
        assert forks.ok and forks.stdout == "parent\n"
        assert (await s.run_python("print('served')")).stdout == "served\n"
        listing = await s.run_python(LIST_PROCS)
    assert len(listing.stdout.splitlines()) <= 4, listing.stdout


@pytest.mark.parametrize(
    ("code", "violation"),
    [
        ("while True: pass", Violation.TIMEOUT),
        ("x = []\nwhile True:\n    x.append(bytearray(10**7))", Violation.MEMORY),
        ("import os\nwhile True:\n    os.fork()", Violation.PROCESSES),
        ("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", Violation.OUTPUT),
    ],
    ids=["loop", "memory", "forkbomb", "flood"],
)
async def test_fork_mode_contains_hostile_code(
    pool_factory: Factory, code: str, violation: Violation
) -> None:
    pool = await pool_factory(python_mode="fork")
    # filling 512 MiB took 2.5 s on the loaded 2-core VM: the memory case must be ended
    # by the memory limit, not raced against the clock
    timeout = 10.0 if violation is Violation.MEMORY else 2.0
    async with pool.session() as s:
        r = await s.run_python(code, timeout=timeout)
        assert r.violation is violation, r
        listing = await s.run_python(LIST_PROCS)
    assert len(listing.stdout.splitlines()) <= 4, listing.stdout
    async with pool.session() as s:
        assert (await s.run_python("print(6 * 7)")).stdout == "42\n"
