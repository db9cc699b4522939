"""The in-sandbox agent: a stdlib-only package, copied into every sandbox whole.

One agent runs per sandbox (container or bubblewrap jail), ideally as PID 1, and
serves length-prefixed JSON frames on unix sockets. Its modules, by job:

- `wire`: the frames (shared with the host's `sandbox.client`);
- `control`: the agent's control loop; opens and closes sessions;
- `slots`: making a session process (as its slot's uid where it can) and wiping a closed one;
- `tenant`: a session's own user, mount, IPC and network namespaces;
- `cgroups`: a session's memory/CPU cgroup (cgroup v1; the host's bwrap backend uses it too);
- `session`: a session process, serving one ``run`` at a time with limits and sweeps;
- `call`: one call in a fresh pre-forked child (`run`, and ``run_python`` in fork mode);
- `interpreter`: the session's persistent interpreter for ``run_python``;
- `terminal` and `shell`: the persistent shell, its framing, its limits and violations;
- `files` and `paths`: the file tools, and opening paths without following links;
- `procs`: the reaper (process-tree walks, stop-then-kill, zombie reaping).

In the sandbox it runs as ``python3 -I -S /opt/agent/agent`` (see `__main__`); on the
host it is importable as `sandbox.agent`. Nothing here may import outside the package
or the standard library.
"""
