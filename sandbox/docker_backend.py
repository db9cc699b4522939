"""The Docker backend: one hardened container per sandbox, through the Docker SDK.

Containers get no network, a read-only root, one tmpfs per session slot, all
capabilities dropped but the four the agent keeps to start sessions as their own uids
(every session slot of every container has a distinct uid) and SYS_ADMIN, which the
agent drops itself once it has made a memory/CPU cgroup per slot (its presence is also
what lets the engine's default seccomp profile allow the namespaces each session gets),
no-new-privileges, memory/CPU/pids limits and the optional runtime (runsc for gVisor).
The agent is PID 1, so the code it runs cannot signal it. Every container carries
labels naming its owner process; `prepare()` removes containers whose owner on this
host is gone (an earlier crash), `stop()` removes one. The SDK is blocking, so every
call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from pathlib import Path

from sandbox.backends import IN_SANDBOX_SOCKETS, IN_SANDBOX_WORK, Handle, owner_alive
from sandbox.config import SandboxConfig
from sandbox.errors import ImageBuildError, SandboxUnavailable

log = logging.getLogger(__name__)

LABEL = "rollout-farm.sandbox"
OWNER_LABEL = "rollout-farm.owner"
# what the agent needs to create sessions (own their tmpfs, become their uid) and to
# end their process trees; sessions themselves run with none. SYS_ADMIN only for the
# agent's start-up (cgroups; docker's seccomp profile admits unshare(2) and mount(2)
# only to containers that have it): the agent drops it before it serves anything.
AGENT_CAPS = ("SETUID", "SETGID", "CHOWN", "KILL", "SYS_ADMIN")


class DockerBackend:
    """Containers from the offline-built image; see module docstring."""

    def __init__(self, config: SandboxConfig, owner: str) -> None:
        self.config, self.owner = config, owner
        self.client = None
        self.image = ""

    async def prepare(self) -> None:
        import docker
        from docker.errors import DockerException, ImageNotFound

        from sandbox.image import image_tag

        self.image = self.config.image or image_tag()
        try:
            self.client = await asyncio.to_thread(docker.from_env, timeout=60)
            await asyncio.to_thread(self.client.ping)
            await asyncio.to_thread(self.client.images.get, self.image)
        except ImageNotFound as exc:
            if self.config.image is not None or not self.config.auto_build:
                await self.close()
                raise SandboxUnavailable(
                    f"image {self.image} is missing; build it with `python -m sandbox.image build`"
                ) from exc
            await self._build()
        except DockerException as exc:
            await self.close()
            raise SandboxUnavailable(f"Docker engine unavailable: {exc}") from exc
        reaped = await asyncio.to_thread(self._reap)
        if reaped:
            log.warning("reaped %d sandbox containers left by dead pools", reaped)

    async def _build(self) -> None:
        """Build the content-tagged image (seconds when the rootfs is cached)."""
        from sandbox.image import build

        log.warning("sandbox image %s is missing; building it offline now", self.image)
        try:
            await asyncio.to_thread(build, True)
        except ImageBuildError as exc:
            await self.close()
            raise SandboxUnavailable(
                f"image {self.image} is missing and did not build: {exc}"
            ) from exc

    def _reap(self) -> int:
        from docker.errors import APIError, NotFound
        from requests.exceptions import RequestException

        reaped = 0
        # the low-level list: the high-level one inspects each container and fails when
        # another pool removes one in between
        for info in self.client.api.containers(all=True, filters={"label": LABEL}):
            owner = (info.get("Labels") or {}).get(OWNER_LABEL, "")
            if owner == self.owner or owner_alive(owner):
                continue
            try:
                self.client.api.remove_container(info["Id"], force=True)
                reaped += 1
            except NotFound:
                continue  # another pool reaped it first
            except APIError:  # another pool's removal is in progress: gone when start returns
                with contextlib.suppress(NotFound, APIError, RequestException):
                    self.client.api.wait(info["Id"], timeout=30, condition="removed")
        return reaped

    async def start(self, name: str, uid: int, socket_dir: Path) -> Handle:
        from docker.errors import DockerException

        try:
            container = await asyncio.to_thread(self._run, name, uid, socket_dir)
        except DockerException as exc:
            raise SandboxUnavailable(f"cannot start sandbox container: {exc}") from exc
        return Handle(name, socket_dir, uid, container)

    def _tmpfs(self, uid: int) -> dict[str, str]:
        """A tmpfs per session slot (its disk limit, owned by its uid). /tmp stays on the
        read-only root (the engine would make a tmpfs there 1777) and /dev/shm is root's:
        no session can write either, so neither is a channel or a trap."""
        cfg = self.config
        mounts = {
            IN_SANDBOX_WORK: "size=1m,mode=0711,uid=0,gid=0",
            "/dev/shm": "size=1m,mode=0755,uid=0,gid=0",
        }
        for slot in range(cfg.sessions_per_sandbox):
            owner = uid + 1 + slot
            mounts[f"{IN_SANDBOX_WORK}/{slot}"] = (
                f"size={cfg.work_mb}m,mode=0700,uid={owner},gid={owner}"
            )
        return mounts

    def _run(self, name: str, uid: int, socket_dir: Path):
        cfg = self.config
        uids = f"{uid + 1}:{cfg.sessions_per_sandbox}"
        memory_mb, session_mb = cfg.memory_plan()
        return self.client.containers.run(
            self.image,
            command=[
                "python3",
                "-I",
                "-S",
                "/opt/agent/agent",
                "--socket-dir",
                IN_SANDBOX_SOCKETS,
                "--work-dir",
                IN_SANDBOX_WORK,
                "--session-uids",
                uids,
                "--host-gid",
                str(os.getegid()),
                "--private-sessions",
                "--session-ptys",
                str(cfg.session_ptys),
                "--session-memory-mb",
                str(session_mb),
            ],
            name=name,
            detach=True,
            # root in the container only to switch each session to its own uid; it
            # keeps just the capabilities for that (AGENT_CAPS)
            user="0:0",
            network_mode="none",
            read_only=True,
            tmpfs=self._tmpfs(uid),
            volumes={str(socket_dir): {"bind": IN_SANDBOX_SOCKETS, "mode": "rw"}},
            cap_drop=["ALL"],
            cap_add=list(AGENT_CAPS),
            security_opt=["no-new-privileges"],
            mem_limit=f"{memory_mb}m",
            memswap_limit=f"{memory_mb}m",
            nano_cpus=int(cfg.cpus * 1e9),
            pids_limit=cfg.pids,
            runtime=cfg.runtime,
            labels={LABEL: "1", OWNER_LABEL: self.owner},
            working_dir=IN_SANDBOX_WORK,
            environment={"PATH": "/usr/local/bin:/usr/bin:/bin"},
            ipc_mode="private",
            log_config={"type": "json-file", "config": {"max-size": "1m"}},
        )

    async def alive(self, handle: Handle) -> bool:
        from docker.errors import DockerException

        try:
            await asyncio.to_thread(handle.native.reload)
        except DockerException:
            return False
        return handle.native.status == "running"

    async def stop(self, handle: Handle) -> None:
        from docker.errors import DockerException, NotFound

        try:
            if handle.native is not None:
                await asyncio.to_thread(handle.native.remove, force=True)
            else:  # the start failed or was cancelled: remove whatever got created
                await asyncio.to_thread(self._remove_by_name, handle.name)
        except NotFound:
            pass
        except DockerException as exc:
            log.warning("could not remove sandbox container %s: %s", handle.name, exc)
        shutil.rmtree(handle.socket_dir, ignore_errors=True)

    def _remove_by_name(self, name: str) -> None:
        if self.client is not None:
            self.client.containers.get(name).remove(force=True)

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await asyncio.to_thread(client.close)
