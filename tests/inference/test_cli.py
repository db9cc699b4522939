"""The server's CLI: config precedence, --help without torch, a real process that stops on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from inference.config import load_server_config
from inference.errors import ConfigError
from tests.inference.conftest import ServerProcess


def test_precedence_cli_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[inference]\nmodel = "/m"\nport = 1111\nmax_batch_size = 8\nweight_version = "3"\n'
    )
    monkeypatch.setenv("FARM_INFERENCE_PORT", "2222")
    monkeypatch.setenv("FARM_INFERENCE_MAX_BATCH_SIZE", "16")
    config = load_server_config({"port": "3333", "model": None}, toml)
    assert (config.port, config.max_batch_size, config.weight_version) == (3333, 16, "3")
    assert str(config.model) == "/m"
    with pytest.raises(ConfigError):
        load_server_config({"model": "/m", "max_batch_size": "0"})
    with pytest.raises(ConfigError):
        load_server_config({"model": "/m", "no_such_flag": "1"})


def test_help_does_not_import_torch() -> None:
    code = "import sys; from inference.__main__ import main\ntry: main(['--help'])\nexcept SystemExit: pass\nassert 'torch' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--api-key" in proc.stdout and "--weight-version" in proc.stdout


def test_the_server_code_is_imported_before_stop_signals_are_handled(model_dir: Path) -> None:
    # prepare runs before the runner handles SIGTERM: what it imports, a SIGTERM interrupts
    code = (
        "import sys\nfrom inference.__main__ import ROLE\nfrom launch.runner import parse\n"
        f"config = parse(ROLE, ['--model', {str(model_dir)!r}])[0]\n"
        "ROLE.prepare(config)\nprint('inference.server' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]


@pytest.mark.slow
async def test_process_serves_with_env_and_toml_config_and_exits_on_sigterm(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text('weight_version = "42"\n')
    monkeypatch.setenv("FARM_INFERENCE_API_KEY", "envkey")
    server = ServerProcess(model_dir, ["--config", str(toml)])
    try:
        server.wait_ready()
        headers = {"Authorization": "Bearer envkey"}
        async with aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as s:
            async with s.get(server.url + "/weight_info") as r:
                assert await r.json() == {"weight_version": "42"}
            async with s.post(
                server.url + "/v1/completions",
                json={"prompt": [1], "max_tokens": 3, "ignore_eos": True},
            ) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
        server.proc.terminate()
        assert server.proc.wait(20) == 0  # clean shutdown on SIGTERM
    finally:
        server.stop()
