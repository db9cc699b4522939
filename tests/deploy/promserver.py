"""A private Prometheus server for tests: loopback port, own config and data directory.

Debian's `prometheus` package provides the binary. `PrometheusApi.query` reads a
PromQL instant query back through the HTTP API (`/api/v1/query`), from this server or
from one a farm started (`farm up --monitor`).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import aiohttp
import yaml

from tests.conftest import free_port, require


class PrometheusApi:
    """The HTTP API of a Prometheus at `url`."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def query(self, promql: str) -> list[dict]:
        return (await self._api("query", {"query": promql}))["result"]

    async def rules(self) -> list[dict]:
        """Every loaded rule with its health and last evaluation error."""
        groups = (await self._api("rules", {}))["groups"]
        return [rule for group in groups for rule in group["rules"]]

    async def _api(self, path: str, params: dict[str, str]) -> dict:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"{self.url}/api/v1/{path}", params=params) as response,
        ):
            body = await response.json()
        assert body["status"] == "success", body
        return body["data"]

    async def wait_ready(self, limit_s: float = 30.0) -> None:
        async with (
            asyncio.timeout(limit_s),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session,
        ):
            while True:
                try:
                    async with session.get(f"{self.url}/-/ready") as response:
                        if response.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)


class PrometheusServer(PrometheusApi):
    """`prometheus` scraping `targets` every second until `stop()`."""

    def __init__(
        self, directory: Path, targets: dict[str, list[str]], rule_files: tuple[Path, ...] = ()
    ) -> None:
        require(shutil.which("prometheus") is not None, "prometheus (Debian package prometheus)")
        self.port = free_port()
        super().__init__(f"http://127.0.0.1:{self.port}")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (directory / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
