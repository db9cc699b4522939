"""A LoRA run's push: each version as a content-named adapter on every server, and what stays.

`AdapterPusher.push(source, version)` writes the version's peft adapter directory, names it
`<run>-v<N>-<digest>` (`inference.adapter_sync`: the name names the bytes), loads it on every
server and verifies it there. A resumed learner's re-trained version N is therefore a new
adapter with its own name and directory, never the pre-crash one that a fixed `<run>-vN`
would leave on the servers. An identical directory (a retried push) keeps its name and path.

What stays loaded: the adapter just pushed and the one this learner pushed before it (workers
one version behind keep generating); every other adapter of the run is unloaded. Before this
learner's first push it has no "before", so the first push unloads nothing: the adapters a
previous learner process left (the one the workers are using among them) go at the second.

What stays on disk: an adapter's directory is removed only once no server has listed the
adapter for `keep_s` seconds, as seen at this learner's pushes (a directory it finds that no
server lists counts from when it first saw it). vLLM reads an adapter again from its path when
it was evicted from the CPU cache (`--max-cpu-loras`), also for a request admitted before the
unload; such a request lives at most the workers' request timeout (300 s by default), so the
default `keep_s` is twice that. A missing directory there is `LoRAAdapterNotFoundError` inside
the engine's step.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from inference.adapter_sync import AdapterSync, adapter_digest, adapter_name, adapter_run
from inference.config import WeightSyncConfig


class AdapterSource(Protocol):
    """What a push writes the adapter from (`learner.weights.WeightSource` is one)."""

    def export(self, out_dir: Path) -> int:
        """Write the peft adapter directory; returns the largest buffer held, in bytes."""
        ...


class AdapterPusher:
    """Push `<run>`'s adapter versions to every server; unload and prune what is no longer used."""

    def __init__(
        self,
        urls: list[str],
        sync_config: WeightSyncConfig,
        run: str,
        keep_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sync = AdapterSync(urls, sync_config)
        self.root = sync_config.root_dir
        self.run = run
        self.keep_s = keep_s
        self._clock = clock
        self._pushed: list[str] = []  # the adapters this learner pushed, the last two
        self._seen: dict[str, float] = {}  # directory name -> when last seen loaded (or found)

    async def push(self, source: AdapterSource, version: int) -> tuple[str, Path, int]:
        """Write, load and verify version `version`; returns (name, directory, the export's
        largest buffer in bytes). `source.export(dir)` writes the adapter directory."""
        name, final, written = await asyncio.to_thread(self._write, source, version)
        await self.sync.load(name, final, version)
        served = await self.sync.served()
        mine = {n for roots in served.values() for n in roots if adapter_run(n) == self.run}
        if name not in self._pushed:  # (a retried push of the same bytes changes nothing)
            self._pushed = [*self._pushed[-1:], name]
        keep = set(self._pushed) if len(self._pushed) == 2 else mine | {name}
        for old in sorted(mine - keep):
            await self.sync.unload(old)
        now = self._clock()
        for loaded in mine | {name}:  # the unloaded ones were loaded until now
            self._seen[loaded] = now
        await asyncio.to_thread(self._prune, keep, now)
        return name, final, written

    def _write(self, source: AdapterSource, version: int) -> tuple[str, Path, int]:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{self.run}-v{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        written = source.export(tmp)
        digest = adapter_digest(tmp)
        name = adapter_name(self.run, version, digest)
        final = self.root / name
        if final.is_dir() and adapter_digest(final) == digest:
            shutil.rmtree(tmp)  # the same bytes are there already (a server may be reading them)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        return name, final, written

    def _prune(self, loaded: set[str], now: float) -> None:
        """Remove this run's adapter directories that no server has listed for `keep_s`, and
        the half-written ones a killed learner left (`.tmp-<run>-v<N>-<pid>`; this learner's
        own are renamed or removed before it prunes)."""
        for path in self.root.glob(f".tmp-{self.run}-v*"):
            if adapter_run(path.name.removeprefix(".tmp-").rsplit("-", 1)[0]) == self.run:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(f"{self.run}-v*"):
            name = path.name
            if adapter_run(name) != self.run or not path.is_dir() or name in loaded:
                continue
            since = self._seen.setdefault(name, now)
            if now - since >= self.keep_s:
                shutil.rmtree(path, ignore_errors=True)
                del self._seen[name]

    async def close(self) -> None:
        await self.sync.close()
