"""The adapter-sync client: serve each LoRA version as a named adapter on every server, verified.

A LoRA run pushes version N as the peft adapter directory the learner wrote, served under the
name `adapter_name(run, N)` = `<run>-vN`, through vLLM 0.33's own runtime-LoRA routes (vLLM
needs `--enable-lora`, `--max-lora-rank`, `--max-loras` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`):

- `load(name, path, version)`: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` on every
  server at once (no pause: generation under other adapters and the base goes on), then
  `GET /v1/models` on every server must list `name` with `root` equal to `path`; otherwise
  `WeightSyncError` (the file push's error) names each server that does not serve it, and
  `farm_weight_sync_served_version{server}` is set to the version where it does. A
  connection error or 5xx is retried `attempts` times; a 4xx is the request's fault and is not.
  A 400 "already been loaded" (a retry whose first answer was lost, or a learner that resumed
  and pushes its checkpoint's version again) counts only if the check then finds the same path
  under the name: write version N's adapter at one fixed path (say `<root_dir>/<run>-vN`).
- `unload(name)`: `POST /v1/unload_lora_adapter {"lora_name"}` on every server; a 404 (not
  loaded there) is already the wanted end state.

Why the version is the name: vLLM's `weight_versions` is one engine-wide label (set by
`/update_weight_version`), the same for every adapter and for the base, so it cannot tell two
runs' adapters apart. An adapter name is loaded once and never replaced (this client never sends
`load_inplace`), so every token generated with `model=<run>-vN` comes from version N: the name
`<run>-vN` is what a worker records as version N, and `load` refuses a name whose `-vN` suffix
disagrees with `version`. The adapter directory must be readable by the servers at the same
path (shared or local disk) for as long as the adapter is loaded: vLLM may evict an adapter
from its CPU cache (`--max-cpu-loras`) and read it again.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference import metrics
from inference.config import WeightSyncConfig
from inference.errors import WeightSyncError
from inference.weight_sync import _ControlClient, _StepFailed

_NAME = re.compile(r"(?P<run>.+)-v(?P<version>\d+)")


def adapter_name(run: str, version: int) -> str:
    """The served name of a run's adapter version: `<run>-v<version>`."""
    if not run:
        raise ValueError("the run name must not be empty")
    if version < 0:
        raise ValueError(f"version must be >= 0, not {version}")
    return f"{run}-v{version}"


def adapter_version(name: str) -> int | None:
    """The version an adapter name carries (`<run>-v<N>` -> N), or None for another name."""
    match = _NAME.fullmatch(name)
    return int(match.group("version")) if match else None


class AdapterSync(_ControlClient):
    """LoRA push over vLLM's adapter routes: `await load(name, path, version)`, `unload(name)`."""

    def __init__(self, urls: Sequence[str], config: WeightSyncConfig) -> None:
        super().__init__(urls, config)
        self._closed = False

    async def load(self, name: str, path: Path, version: int) -> None:
        """Load the peft adapter directory `path` as `name` on every server, and verify it."""
        self._check_open()
        if adapter_version(name) != version:
            raise ValueError(
                f"adapter name {name!r} does not carry version {version} (-v{version})"
            )
        body = {"lora_name": name, "lora_path": str(path)}
        async with self._session() as session:

            async def attempt(url: str) -> None:
                try:
                    await self._call(
                        session, "POST", f"{url}/v1/load_lora_adapter", body, text=True
                    )
                except _StepFailed as exc:
                    if exc.status == 400 and "already been loaded" in str(exc):
                        return  # the check below decides whether it is this adapter
                    raise

            reasons = await asyncio.gather(
                *(self._transient_retries(u, attempt) for u in self.urls)
            )
        failures = {u: r for u, r in zip(self.urls, reasons, strict=True) if r}
        await self.verify_adapter(name, str(path), version, failures)

    async def verify_adapter(
        self, name: str, path: str, version: int, failures: dict[str, str] | None = None
    ) -> None:
        """Every server must list `name` from `path` on /v1/models; WeightSyncError otherwise."""
        failures = dict(failures or {})
        async with self._session() as session:
            for url in self.urls:
                if url in failures:
                    continue
                try:
                    listing = await self._call(session, "GET", f"{url}/v1/models")
                except _StepFailed as exc:
                    failures[url] = str(exc)
                    continue
                roots = _adapter_roots(listing)
                if roots.get(name) == path:
                    # this run's served version, as the file push sets it (alerts compare it)
                    metrics.SYNC_SERVED_VERSION.labels(server=url).set(version)
                else:
                    failures[url] = (
                        f"does not serve adapter {name!r} from {path}"
                        if name not in roots
                        else f"serves adapter {name!r} from {roots[name]}, not {path}"
                    )
        if failures:
            raise WeightSyncError(version, failures, f"adapter {name} not served everywhere")

    async def unload(self, name: str) -> None:
        """Stop serving `name` on every server (requests already running under it finish)."""
        self._check_open()
        body = {"lora_name": name}
        async with self._session() as session:

            async def attempt(url: str) -> None:
                try:
                    await self._call(
                        session, "POST", f"{url}/v1/unload_lora_adapter", body, text=True
                    )
                except _StepFailed as exc:
                    if exc.status != 404:  # 404: not loaded there, which is what we want
                        raise

            reasons = await asyncio.gather(
                *(self._transient_retries(u, attempt) for u in self.urls)
            )
        failures = {u: r for u, r in zip(self.urls, reasons, strict=True) if r}
        if failures:
            version = adapter_version(name)
            raise WeightSyncError(
                -1 if version is None else version,
                failures,
                f"adapter {name} not unloaded everywhere",
            )

    async def close(self) -> None:
        """Refuse further calls (each call opens and closes its own HTTP session)."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("AdapterSync is closed")

    async def _transient_retries(self, url: str, attempt: Any) -> str | None:
        """`attempt(url)` up to `attempts` times while it fails transiently (no answer, 5xx);
        None on success, else the last reason."""
        reason = "not attempted"
        for i in range(self.config.attempts):
            try:
                await attempt(url)
                return None
            except _StepFailed as exc:
                reason = str(exc)
                metrics.SYNC_FAILURES.labels(server=url).inc()
                if exc.status is not None and exc.status < 500:
                    break
                if i + 1 < self.config.attempts:
                    await asyncio.sleep(self.config.backoff_s)
        return reason


def _adapter_roots(listing: Any) -> dict[str, str]:
    """Adapter name -> root path from a /v1/models body (cards with a parent are adapters)."""
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        return {}
    return {
        str(card.get("id")): str(card.get("root"))
        for card in cards
        if isinstance(card, dict) and card.get("parent")
    }
