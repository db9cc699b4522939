"""The adapter-sync client: serve each LoRA version as a named adapter on every server, verified.

A LoRA run pushes version N as the peft adapter directory the learner wrote, through vLLM 0.33's
own runtime-LoRA routes (vLLM needs `--enable-lora`, `--max-lora-rank`, `--max-loras` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`):

- `load(name, path, version)`: `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` on every
  server at once (no pause: generation under other adapters and the base goes on), then
  `GET /v1/models` on every server must list `name` with `root` equal to `path`; otherwise
  `WeightSyncError` (the file push's error) names each server that does not serve it, and
  `farm_weight_sync_served_version{server}` is set to the version where it does. A
  connection error or 5xx is retried `attempts` times; a 4xx is the request's fault and is not.
  A 400 "already been loaded" (a retry whose first answer was lost) counts only if the check
  then finds the same path under the name.
- `unload(name)`: `POST /v1/unload_lora_adapter {"lora_name"}` on every server; a 404 (not
  loaded there) is already the wanted end state.
- `served()`: every server's adapters, name -> path, from `GET /v1/models`.

**A name names the bytes.** The learner serves version N of run R as
`adapter_name(R, N, adapter_digest(dir))` = `R-vN-<digest>`, the digest being of the adapter's
two files. vLLM 0.33 keys everything about an adapter on its name: a name already loaded is
refused (`load_inplace` aside), and its `LoRARequest` hashes and compares by name alone. A learner
that resumes from a checkpoint trains versions again that the servers may still hold under
the old weights; a fixed name per version would either keep serving those ("already loaded")
or need one of the two ways to replace a name, both unsafe in 0.33 (`docs/inference.md`,
"Replacing an adapter"): `load_inplace` keeps the old `lora_int_id`, and running requests that
still carry the old path make the worker re-read the old directory when the adapter is evicted
from its CPU cache; unload-and-reload gives the name a second `lora_int_id`, and a batch holding
requests of both ids collapses them into one set entry (by name), so one id is never activated.
With the digest in the name, a re-trained version is a new adapter, and an identical one (a
retried push) is the same adapter at the same path. This client never sends `load_inplace`.

Why the version is in the name at all: vLLM's `weight_versions` is one engine-wide label (set by
`/update_weight_version`), the same for every adapter and for the base, so it cannot tell two
runs' adapters apart. A worker records the version the published `PolicyVersion` gives with the
name, and `load` refuses a name whose `-vN` disagrees with `version`. The adapter directory must
be readable by the servers at the same path (shared or local disk) while any request may still
use the adapter: vLLM may evict an adapter from its CPU cache (`--max-cpu-loras`) and read it
again from its path, also for a request admitted before the adapter was unloaded
(`learner.adapter_push` keeps directories by that rule).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inference import metrics
from inference.config import WeightSyncConfig
from inference.errors import WeightSyncError
from inference.weight_sync import _ControlClient, _StepFailed

DIGEST_CHARS = 12  # 48 bits of sha256: two re-trainings of one version never share a name
_NAME = re.compile(rf"(?P<run>.+)-v(?P<version>\d+)(?:-(?P<digest>[0-9a-f]{{{DIGEST_CHARS}}}))?")
# what the digest covers: the files vLLM (and peft, and the CPU server) read
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_name(run: str, version: int, digest: str = "") -> str:
    """The served name of a run's adapter version: `<run>-v<version>`, with `-<digest>`
    (`adapter_digest` of its directory) when given, as the learner names what it pushes."""
    if not run:
        raise ValueError("the run name must not be empty")
    if version < 0:
        raise ValueError(f"version must be >= 0, not {version}")
    if digest and not re.fullmatch(rf"[0-9a-f]{{{DIGEST_CHARS}}}", digest):
        raise ValueError(f"digest must be {DIGEST_CHARS} lowercase hex digits, not {digest!r}")
    return f"{run}-v{version}-{digest}" if digest else f"{run}-v{version}"


def adapter_version(name: str) -> int | None:
    """The version an adapter name carries (`<run>-v<N>[-<digest>]` -> N), or None."""
    match = _NAME.fullmatch(name)
    return int(match.group("version")) if match else None


def adapter_run(name: str) -> str | None:
    """The run an adapter name belongs to (`<run>-v<N>[-<digest>]` -> run), or None."""
    match = _NAME.fullmatch(name)
    return match.group("run") if match else None


def adapter_digest(directory: Path) -> str:
    """The digest of a peft adapter directory's files, for `adapter_name`; OSError if one of
    them is missing."""
    sha = hashlib.sha256()
    for file in ADAPTER_FILES:
        path = Path(directory) / file
        sha.update(f"{file}:{path.stat().st_size}\n".encode())  # where one file ends
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha.update(chunk)
    return sha.hexdigest()[:DIGEST_CHARS]


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
        listings = await self._listings([u for u in self.urls if u not in failures])
        for url, roots in listings.items():
            if isinstance(roots, str):
                failures[url] = roots
                continue
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

    async def served(self) -> dict[str, dict[str, str]]:
        """Each server's adapters (name -> path); WeightSyncError if a server cannot say."""
        listings = await self._listings(self.urls)
        failures = {url: roots for url, roots in listings.items() if isinstance(roots, str)}
        if failures:
            raise WeightSyncError(-1, failures, "adapters not listed")
        return {url: roots for url, roots in listings.items() if isinstance(roots, dict)}

    async def _listings(self, urls: Sequence[str]) -> dict[str, dict[str, str] | str]:
        """GET /v1/models of each of `urls`: its adapters, or why it gave none."""
        out: dict[str, dict[str, str] | str] = {}
        async with self._session() as session:
            for url in urls:
                try:
                    out[url] = _adapter_roots(await self._call(session, "GET", f"{url}/v1/models"))
                except _StepFailed as exc:
                    out[url] = str(exc)
        return out

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
