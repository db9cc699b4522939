"""An attacker session against a victim session of the same pool, on both backends.

Every attack must fail (each probe reports what the kernel answered), and the victim
keeps its files and answers its next call. On Docker both sessions share one container
(`sessions_per_sandbox=4`); on bwrap each session has its own jail, which the test
checks too.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from pathlib import Path

from sandbox import SandboxPool, Violation
from sandbox.backends import AGENT_PACKAGE

VICTIM_SETUP = """
import os, tempfile
open('secret.txt', 'w').write('victim-secret')
os.makedirs('sub', exist_ok=True)
open('sub/answer.py', 'w').write('X = 1')
print(json.dumps({'pid': os.getppid(), 'me': os.getpid(), 'cwd': os.getcwd(),
                  'tmp': tempfile.gettempdir(), 'uid': os.getuid()}))
""".replace("import os", "import json, os")

# each probe prints name -> "denied: <error>" or "DONE"; any DONE is a breach
ATTACK = """
import ctypes, json, os, signal, socket
v = json.loads({victim!r})
out = {{}}
def probe(name, fn):
    try:
        fn()
        out[name] = 'DONE'
    except OSError as exc:
        out[name] = 'denied: ' + type(exc).__name__
def read(): open(v['cwd'] + '/secret.txt').read()
def write(): open(v['cwd'] + '/secret.txt', 'w').write('pwned')
def listing(): os.listdir(v['cwd'])
def rename(): os.rename(v['cwd'] + '/secret.txt', v['cwd'] + '/moved')
def delete(): os.unlink(v['cwd'] + '/secret.txt')
def tmp_read(): os.listdir(v['tmp'])
def kill_pid(): os.kill(v['pid'], signal.SIGKILL)
def ptrace():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(16, v['pid'], None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), 'ptrace')
def proc(entry):
    def f():
        path = '/proc/%d/%s' % (v['pid'], entry)
        if entry in ('fd', 'cwd'):
            os.listdir(path)
        else:
            open(path, 'rb').read(1)
    return f
def agent_socket():
    s = socket.socket(socket.AF_UNIX)
    s.connect('/run/agent/agent.sock')
def plant(where):
    def f():
        os.symlink(v['cwd'] + '/secret.txt', where + '/planted-link')
    return f
def plant_file(where):
    def f():
        open(where + '/planted', 'w').write('x')
    return f
def victim_visible():
    # another uid's process (seen as an unmapped uid from a session's user namespace),
    # not one of this jail's own
    try:
        return os.stat('/proc/%d' % v['pid']).st_uid != os.getuid()
    except OSError:
        return False
visible = victim_visible()  # False in another jail, where the pid names someone else
pid_probes = ('kill', 'ptrace', 'environ', 'fd', 'mem', 'cwd')
for name, fn in [('read', read), ('write', write), ('list', listing), ('rename', rename),
                 ('delete', delete), ('tmp', tmp_read), ('kill', kill_pid),
                 ('ptrace', ptrace), ('environ', proc('environ')), ('fd', proc('fd')),
                 ('mem', proc('mem')), ('cwd', proc('cwd')), ('socket', agent_socket),
                 ('tmp_link', plant('/tmp')), ('shm_link', plant('/dev/shm')),
                 ('tmp_file', plant_file('/tmp')), ('shm_file', plant_file('/dev/shm'))]:
    if name in pid_probes and not visible:
        out[name] = 'denied: not visible'
    else:
        probe(name, fn)
print(json.dumps({{'visible': visible, 'probes': out}}))
"""

FILL_DISK = """
import os
n = 0
try:
    while True:
        with open('fill-%d' % n, 'wb') as f:
            f.write(b'x' * (1 << 20))
        n += 1
except OSError as exc:
    print(n, exc.errno)
"""

VICTIM_CHECK = """
import os
print(open('secret.txt').read(), open('sub/answer.py').read())
open('more.bin', 'wb').write(b'y' * (4 << 20))
print(sorted(os.listdir('.')), os.path.exists('/tmp/planted'), os.path.exists('/dev/shm/planted'))
"""


async def test_an_attacker_session_cannot_reach_its_neighbour(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=4, work_mb=24)
    async with pool.session() as victim, pool.session() as attacker:
        assert (victim.sandbox is attacker.sandbox) == (pool.config.backend == "docker")
        setup = await victim.run_python(VICTIM_SETUP)
        assert setup.ok, setup
        info = json.loads(setup.stdout)
        r = await attacker.run_python(ATTACK.format(victim=setup.stdout.strip()))
        assert r.ok, r
        report = json.loads(r.stdout)
        probes = report["probes"]
        assert len(probes) == 17
        # one container: the victim's processes are visible, so the pid attacks ran
        assert report["visible"] == (pool.config.backend == "docker")
        breached = {k for k, v in probes.items() if v == "DONE"}
        # its own /tmp and /dev/shm: private to the session, not shared places (the
        # victim's check below sees none of it)
        breached -= {"tmp_link", "shm_link", "tmp_file", "shm_file"}
        assert not breached, probes
        mine = await attacker.run_python(
            "import os, tempfile; print(os.getuid(), tempfile.gettempdir())"
        )
        uid, tmp = mine.stdout.split()
        assert tmp != info["tmp"]
        if pool.config.backend == "docker":  # one container: distinct uids are the wall
            assert int(uid) != info["uid"]
        filled = await attacker.run_python(FILL_DISK, timeout=30)
        count, err = filled.stdout.split()
        assert int(count) <= 24 and int(err) in (28, 122), filled  # ENOSPC / EDQUOT
        killer = await attacker.run_python("import os, signal; os.kill(-1, signal.SIGKILL)")
        assert killer.violation in (Violation.SESSION_LOST, Violation.MEMORY), killer
        check = await victim.run_python(VICTIM_CHECK)
    assert check.ok, check
    lines = check.stdout.splitlines()
    assert lines[0] == "victim-secret X = 1"
    assert lines[1] == "['more.bin', 'secret.txt', 'sub'] False False"


async def test_concurrent_victim_socket_is_unreachable(pool_factory) -> None:
    """A unix socket the victim listens on in its work dir cannot be connected to."""
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=4)
    async with pool.session() as victim, pool.session() as attacker:
        cwd = (await victim.run_python("import os; print(os.getcwd())")).stdout.strip()
        listen = victim.run_python(
            "import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.bind('l.sock')\n"
            "s.listen(1)\ns.settimeout(3)\ntry:\n    s.accept(); print('accepted')\n"
            "except OSError:\n    print('nobody')",
            timeout=10,
        )
        connect = attacker.run_python(
            f"import socket, time\ntime.sleep(0.5)\ns = socket.socket(socket.AF_UNIX)\n"
            f"try:\n    s.connect('{cwd}/l.sock'); print('connected')\n"
            f"except OSError as e:\n    print('denied', type(e).__name__)",
            timeout=10,
        )
        heard, tried = await asyncio.gather(listen, connect)
    assert heard.stdout == "nobody\n", heard
    assert tried.stdout.startswith("denied"), tried


SELF_CHECK = """
import os, stat, tempfile
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())
agent = dict(l.split(':', 1) for l in open('/proc/1/status').read().splitlines())
print(status['CapEff'].strip(), status['CapPrm'].strip(), status['NoNewPrivs'].strip(),
      oct(os.umask(0o077)), oct(stat.S_IMODE(os.stat('.').st_mode)),
      oct(stat.S_IMODE(os.stat(tempfile.gettempdir()).st_mode)),
      os.environ['HOME'] == os.getcwd(), agent['CapEff'].strip())
"""


async def test_sessions_have_no_capabilities_and_private_dirs(pool_factory) -> None:
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=2)
    async with pool.session() as s:
        r = await s.run_python(SELF_CHECK)
    assert r.ok, r
    eff, prm, nnp, umask, work_mode, tmp_mode, home, agent_caps = r.stdout.split()
    assert (eff, prm, nnp) == ("0000000000000000", "0000000000000000", "1")
    assert (umask, work_mode, tmp_mode, home) == ("0o77", "0o700", "0o700", "True")
    # docker: the agent keeps CHOWN, KILL, SETGID, SETUID only; bwrap: nothing at all
    assert int(agent_caps, 16) == (0xE1 if pool.config.backend == "docker" else 0)


async def test_a_reused_slot_starts_empty(pool_factory) -> None:
    """A closed session's files are wiped (as its uid) before its slot serves again."""
    pool: SandboxPool = await pool_factory(sessions_per_sandbox=1, max_sandboxes=1, warm=1)
    async with pool.session() as first:
        await first.run_python(
            "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d', 0)"
        )
        uid = (await first.run_python("import os; print(os.getuid())")).stdout
    async with pool.session() as second:
        r = await second.run_python("import os; print(os.getuid(), os.listdir('.'))")
    assert r.ok, r
    if pool.config.backend == "docker":  # same container, same slot, same uid
        assert first.sandbox is second.sandbox and r.stdout.split()[0] == uid.strip()
    assert r.stdout.split(" ", 1)[1] == "[]\n"


def test_agent_refuses_to_share_a_uid_when_asked_to_isolate() -> None:
    """Without root in the sandbox the agent cannot give sessions their own uids: it
    must not start at all rather than quietly run every session as itself."""
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:  # reachable by uid 65534
        _agent_refuses(Path(scratch))


def _agent_refuses(tmp_path: Path) -> None:
    sockets, work = tmp_path / "s", tmp_path / "w"
    sockets.mkdir()
    tmp_path.chmod(0o777)
    sockets.chmod(0o777)
    user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    argv = [
        "/usr/bin/python3",
        "-I",
        "-S",
        str(AGENT_PACKAGE),
        "--socket-dir",
        str(sockets),
        "--work-dir",
        str(work),
        "--session-uids",
        "300001:2",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, **user)
    assert done.returncode != 0
    assert "needs root in the sandbox" in done.stderr
    assert not (sockets / "agent.sock").exists()
