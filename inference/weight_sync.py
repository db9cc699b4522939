"""The weight-sync client: move every inference server to a new weight version and verify it.

File path (`FileWeightSync`, the default): save the model as safetensors in Hugging Face layout to
`<root>/v<version>` (written to a temporary directory, then renamed, so a server never reads a
half-written version), then on every server, concurrently: `POST /pause?mode=keep`,
`POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": dir}}`,
`POST /update_weight_version {"new_version": "<version>"}`, `POST /reset_prefix_cache`,
`POST /resume` (resume also runs after a failure, so a server is never left paused; it then keeps
serving its old version under its old label). A failed server is retried `attempts` times. Last,
`GET /weight_info` on every server must report the new version; otherwise `WeightSyncError` names
each server that is not serving it. The farm never believes a version a server has not confirmed.
The weight directory must be readable by the servers at the same path (shared or local disk).

NCCL path (`NcclWeightSync`), vLLM 0.33's choreography: `init()` reads each server's world size,
lays out the ranks and posts `/init_weight_transfer_engine` to every server while the trainer
joins the group; `push()` posts `/pause?mode=keep`, `/start_weight_update`, `/update_weights`
(while the transport broadcasts), `/finish_weight_update {"weight_version"}`, `/resume`, then
verifies. The tensor transport is pluggable: `inference.nccl.NcclTransport` over vLLM's
trainer_init, or over its gloo stand-in, which the CPU policy server receives with. A failed
push leaves the group closed (`ready` is False): `init()` forms a new one before the next push.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from inference import metrics
from inference.config import WeightSyncConfig
from inference.errors import WeightSyncError, error_excerpt
from inference.nccl import WeightStream, rank_offsets

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class _StepFailed(Exception):
    """One control call failed (status or connection); the message says which and why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status when the server answered


def _route(url: str) -> str:
    return url.rsplit("/", 1)[-1]


class _ControlClient:
    """Shared HTTP plumbing: authorised JSON calls with a timeout, errors as _StepFailed."""

    def __init__(self, urls: Sequence[str], config: WeightSyncConfig) -> None:
        if not urls:
            raise ValueError("at least one server URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.config = config

    def _session(self) -> aiohttp.ClientSession:
        key = self.config.api_key
        headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
        return aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=self.config.timeout_s)
        )

    async def _call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        json: Any = None,
        *,
        text: bool = False,
    ) -> Any:
        """The decoded JSON answer (None if empty); with `text`, the body as text (vLLM's
        LoRA routes answer plain text)."""
        try:
            async with session.request(method, url, json=json) as resp:
                body = await resp.read()
                if not 200 <= resp.status < 300:
                    raise _StepFailed(
                        f"{method} {_route(url)} -> HTTP {resp.status}: {error_excerpt(body)}",
                        resp.status,
                    )
                if text:
                    return body.decode("utf-8", "replace")
                return orjson.loads(body) if body.strip() else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise _StepFailed(f"{method} {_route(url)}: {type(exc).__name__}: {exc}") from exc

    async def _with_retries(self, url: str, attempt: Any) -> str | None:
        """Run `attempt()` up to `attempts` times; None on success, else the last reason."""
        reason = "not attempted"
        for i in range(self.config.attempts):
            try:
                await attempt()
                return None
            except _StepFailed as exc:
                reason = str(exc)
                metrics.SYNC_FAILURES.labels(server=url).inc()
                if i + 1 < self.config.attempts:
                    await asyncio.sleep(self.config.backoff_s)
        return reason

    async def _paused(self, session: aiohttp.ClientSession, url: str, steps: Any) -> None:
        await self._call(session, "POST", f"{url}/pause?mode={self.config.pause_mode}")
        try:
            await steps()
        finally:
            try:
                await self._call(session, "POST", f"{url}/resume")
            except _StepFailed:
                pass  # the update's own failure (if any) is what gets reported; verify catches the rest

    async def verify(self, version: int, failures: dict[str, str] | None = None) -> None:
        """Every server must report `version` on /weight_info; raise WeightSyncError otherwise."""
        failures = dict(failures or {})
        async with self._session() as session:
            for url in self.urls:
                try:
                    info = await self._call(session, "GET", f"{url}/weight_info")
                    served = str(info.get("weight_version")) if isinstance(info, dict) else None
                except _StepFailed as exc:
                    failures.setdefault(url, str(exc))
                    continue
                if served is not None and served.lstrip("-").isdigit():
                    metrics.SYNC_SERVED_VERSION.labels(server=url).set(int(served))
                if served != str(version):
                    failures.setdefault(url, f"serves version {served!r}")
        if failures:
            raise WeightSyncError(version, failures)


class FileWeightSync(_ControlClient):
    """Weight push through files: `await push(model, tokenizer_dir, version)`."""

    async def push(self, model: Any, tokenizer_dir: str | Path | None, version: int) -> Path:
        """Save `model`, load it on every server, verify; returns the weight directory."""
        path = await asyncio.to_thread(
            save_weights, model, tokenizer_dir, self.config.root_dir, version
        )
        await self.push_path(path, version)
        await asyncio.to_thread(
            prune_versions, self.config.root_dir, self.config.keep_versions, path
        )
        return path

    async def push_path(self, path: Path, version: int) -> None:
        """Load an already saved weight directory on every server and verify the version."""
        async with self._session() as session:

            async def update(url: str) -> None:
                async def steps() -> None:
                    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                    await self._call(session, "POST", f"{url}/collective_rpc", rpc)
                    await self._call(
                        session,
                        "POST",
                        f"{url}/update_weight_version",
                        {"new_version": str(version)},
                    )
                    await self._call(session, "POST", f"{url}/reset_prefix_cache")

                await self._paused(session, url, steps)

            reasons = await asyncio.gather(
                *(self._with_retries(u, lambda u=u: update(u)) for u in self.urls)
            )
        await self.verify(version, {u: r for u, r in zip(self.urls, reasons, strict=True) if r})


def save_weights(model: Any, tokenizer_dir: str | Path | None, root: Path, version: int) -> Path:
    """Write `<root>/v<version>` atomically: safetensors weights (+ config, tokenizer files)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:08d}"
    tmp = root / f".tmp-v{version:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(tmp)
    else:
        from safetensors.torch import save_file

        tmp.mkdir()
        tensors: Mapping[str, Any] = model
        save_file(
            {k: v.detach().contiguous().clone() for k, v in tensors.items()},
            tmp / "model.safetensors",
        )
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def prune_versions(root: Path, keep: int, current: Path) -> None:
    """Remove all but the newest `keep` version directories (never `current`)."""
    versions = sorted(p for p in Path(root).glob("v*") if p.is_dir())
    for old in versions[:-keep]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


class Transport(Protocol):
    """Moves tensors to the servers between /start_weight_update and /finish_weight_update."""

    @property
    def ready(self) -> bool: ...

    def init_info(self, rank_offset: int, world_size: int) -> dict[str, Any]: ...

    async def start(self, world_size: int) -> None: ...

    def update_info(self, stream: WeightStream) -> dict[str, Any]: ...

    async def send(self, stream: WeightStream) -> None: ...

    def close(self) -> None: ...


class NcclWeightSync(_ControlClient):
    """Weight push over vLLM 0.33's NCCL routes; `await init()` once, then `await push(...)`.

    Each server's world size (its TP x PP x DP workers) comes from `config.server_world_sizes`
    when set, else from the server's own `GET /get_world_size?include_dp=true` (a vLLM 0.33
    dev-mode route). Server i gets `rank_offset` = 1 + the world sizes of servers 0..i-1.
    """

    def __init__(self, urls: Sequence[str], config: WeightSyncConfig, transport: Transport) -> None:
        super().__init__(urls, config)
        self.transport = transport
        self.rank_offsets: list[int] = []
        self.world_size = 0

    async def world_sizes(self) -> list[int]:
        """Every server's worker count, from the configuration or from the server."""
        if self.config.server_world_sizes is not None:
            if len(self.config.server_world_sizes) != len(self.urls):
                raise ValueError("server_world_sizes needs one entry per server URL")
            return list(self.config.server_world_sizes)
        async with self._session() as session:
            answers = await asyncio.gather(
                *(
                    self._call(session, "GET", f"{u}/get_world_size?include_dp=true")
                    for u in self.urls
                )
            )
        sizes = [a.get("world_size") if isinstance(a, dict) else None for a in answers]
        bad = {u: repr(s) for u, s in zip(self.urls, sizes, strict=True) if not _positive_int(s)}
        if bad:
            raise WeightSyncError(
                -1, {u: f"/get_world_size answered {s}" for u, s in bad.items()}, _NO_GROUP
            )
        return [int(s) for s in sizes]  # type: ignore[arg-type]

    async def init(self) -> None:
        """Form the transfer group: the trainer and every server's workers join at once."""
        try:
            sizes = await self.world_sizes()
        except _StepFailed as exc:
            raise WeightSyncError(-1, {u: str(exc) for u in self.urls}, _NO_GROUP) from exc
        self.rank_offsets, self.world_size = rank_offsets(sizes)
        async with self._session() as session:
            joins = [
                self._call(
                    session,
                    "POST",
                    f"{url}/init_weight_transfer_engine",
                    {"init_info": self.transport.init_info(offset, self.world_size)},
                )
                for url, offset in zip(self.urls, self.rank_offsets, strict=True)
            ]
            # Wait for every side, even after a refusal: the trainer's rendezvous ends only by
            # its own timeout, and a thread cannot be cancelled.
            trainer, *answers = await asyncio.gather(
                self.transport.start(self.world_size), *joins, return_exceptions=True
            )
        failures = {
            u: str(a)
            for u, a in zip(self.urls, answers, strict=True)
            if isinstance(a, BaseException)
        }
        if isinstance(trainer, BaseException) and not failures:
            failures = {u: f"trainer rendezvous: {trainer!r}" for u in self.urls}
        if failures:
            self.transport.close()
            raise WeightSyncError(-1, failures, _NO_GROUP)

    @property
    def ready(self) -> bool:
        """Whether the group is formed; False before `init()` and after a failed push."""
        return self.transport.ready

    async def push(self, weights: Mapping[str, Any] | WeightStream, version: int) -> None:
        """Pause, start, update (while broadcasting), finish with the version, resume, verify.

        A failure closes the group on both sides (the servers keep their old version):
        call `init()` again before the next push."""
        if not self.transport.ready:
            raise WeightSyncError(version, {u: "call init() first" for u in self.urls}, _NO_GROUP)
        stream = weights if isinstance(weights, WeightStream) else WeightStream.of(weights)
        update = {"update_info": self.transport.update_info(stream)}
        failures: dict[str, str] = {}
        async with self._session() as session:

            async def on_all(path: str, body: Any = None) -> None:
                answers = await asyncio.gather(
                    *(self._call(session, "POST", u + path, body) for u in self.urls),
                    return_exceptions=True,
                )
                _raise_first(answers)

            try:
                await on_all(f"/pause?mode={self.config.pause_mode}")
                await on_all("/start_weight_update")
                # The servers receive inside /update_weights: both sides must be in the collective.
                _raise_first(
                    await asyncio.gather(
                        on_all("/update_weights", update),
                        self._send(stream),
                        return_exceptions=True,
                    )
                )
                await on_all("/finish_weight_update", {"weight_version": str(version)})
            except _StepFailed as exc:  # a collective transfer fails as a whole
                self.transport.close()
                failures = {u: str(exc) for u in self.urls}
                for url in self.urls:
                    metrics.SYNC_FAILURES.labels(server=url).inc()
            finally:
                for url in self.urls:
                    try:
                        await self._call(session, "POST", f"{url}/resume")
                    except _StepFailed:
                        pass  # verify() reports a server that cannot be reached
        await self.verify(version, failures)

    async def _send(self, stream: WeightStream) -> None:
        try:
            await self.transport.send(stream)
        except Exception as exc:  # gloo/NCCL errors, a stream that disagrees with its metadata
            raise _StepFailed(f"trainer broadcast: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Leave the group (the servers notice at their next transfer)."""
        self.transport.close()


def _raise_first(answers: Sequence[Any]) -> None:
    """Raise the first failure among gathered answers (all of them in its message)."""
    errors = [a for a in answers if isinstance(a, BaseException)]
    if not errors:
        return
    if all(isinstance(e, _StepFailed) for e in errors):
        raise _StepFailed("; ".join(dict.fromkeys(str(e) for e in errors)))
    raise errors[0]


_NO_GROUP = "weight transfer group not formed"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
