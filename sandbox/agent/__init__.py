"""The in-sandbox agent: a stdlib-only package, copied into every sandbox whole.

One agent runs per sandbox (container or bubblewrap jail), ideally as PID 1, and
serves length-prefixed JSON frames on unix sockets. Its modules, by job:

- `wire`: the frames (shared with the host's `sandbox.client`);
- `control`: the agent's control loop; opens each session as its own uid where it can;
- `session`: a session process, serving one ``run`` at a time with limits and sweeps;
- `call`: one call in a fresh pre-forked child (`run`, and ``run_python`` in fork mode);
- `interpreter`: the session's persistent interpreter for ``run_python``;
- `procs`: the reaper (process-tree walks, stop-then-kill, zombie reaping).

In the sandbox it runs as ``python3 -I -S /opt/agent/agent`` (see `__main__`); on the
host it is importable as `sandbox.agent`. Nothing here may import outside the package
or the standard library.
"""
