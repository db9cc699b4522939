"""deploy/compose/docker-compose.yml: valid for docker compose, scalable, both profiles sane.

`docker-compose config` (Debian package docker-compose) or `docker compose config`
resolves and validates the file for each profile; the structural checks pin what
the issue asks of it (vLLM with the RL routes on a GPU, a CPU profile with the CPU
policy server, workers that scale).
"""

from __future__ import annotations

import json
import subprocess
import tomllib

import pytest
import yaml

from tests.deploy.compose import COMPOSE, compose_cli, gpu_profile
from tests.deploy.promql import DEPLOY, ROOT


def _services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_config_resolves(profile: str) -> None:
    result = subprocess.run(
        [*compose_cli(), "-f", str(COMPOSE), "--profile", profile, "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=COMPOSE.parent,
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert {"redis", "worker", "prometheus", "grafana"} <= set(resolved)
    # (docker-compose 1.29's `config` lists every profile's services)
    assert _services()["grafana"]["profiles"] == ["grafana"], "its image needs a registry: opt-in"


def test_compose_rejects_a_broken_file(tmp_path) -> None:
    """The validation above can fail: an unknown service key is refused."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  redis:\n    image: redis\n    no_such_key: 1\n")
    result = subprocess.run(
        [*compose_cli(), "-f", str(bad), "config"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0


def _gpus(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    return device["device_ids"]


def test_vllm_servers_come_from_one_template_on_gpus_of_their_own() -> None:
    """Every vllm-N service is the x-vllm template (RL routes on) plus its own GPUs, none
    shared with another server or the learner, and the learner pushes to each of them."""
    services = gpu_profile()
    servers = sorted(n for n in services if n.startswith("vllm-"))
    assert len(servers) >= 2
    template = yaml.safe_load(COMPOSE.read_text())["x-vllm"]
    for name in servers:
        vllm = services[name]
        assert vllm["profiles"] == ["gpu"]
        assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
        assert (vllm["entrypoint"], vllm["command"]) == (
            template["entrypoint"],
            template["command"],
        )
    reserved = [gpu for name in [*servers, "learner"] for gpu in _gpus(services[name])]
    assert len(reserved) == len(set(reserved)), reserved
    learner = services["learner"]
    urls = learner["environment"]["FARM_INFERENCE_URLS"].split(",")
    assert urls == [f"http://{name}:8000" for name in servers]
    # one torchrun rank per GPU the learner reserves
    assert learner["entrypoint"][:3] == ["python", "-m", "farm.torchrun"]
    assert "--nproc-per-node=gpu" in learner["entrypoint"]


def test_cpu_profile_serves_the_cpu_policy_server_under_the_same_name() -> None:
    services = _services()
    policy = services["policy"]
    assert policy["profiles"] == ["cpu"]
    assert policy["entrypoint"] == ["python", "-m", "inference"]
    assert "inference" in policy["networks"]["default"]["aliases"]
    assert "deploy" not in services["learner-cpu"], "the CPU learner must not reserve a GPU"


def test_workers_can_scale() -> None:
    worker = _services()["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker, "fixed host ports would collide under --scale"
    assert "profiles" not in worker, "workers run in both profiles"
    # the CPU server's name unless FARM_INFERENCE_URLS lists the vLLM servers
    assert (
        worker["environment"]["FARM_INFERENCE_URLS"]
        == "${FARM_INFERENCE_URLS:-http://inference:8000}"
    )


def test_build_contexts_and_mounted_files_exist() -> None:
    for name, svc in _services().items():
        build = svc.get("build")
        if build:
            context = (COMPOSE.parent / build["context"]).resolve()
            assert context == ROOT, name
            assert (context / build["dockerfile"]).is_file(), name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("../"):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source} missing"


@pytest.mark.parametrize("dockerfile", ["worker", "learner"])
def test_project_images_copy_every_package_the_project_installs(dockerfile: str) -> None:
    """`pip install .` in the image finds only the packages copied in: one left out (the
    learner image once lacked `launch/`) fails at the first import, not at build time."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in include}
    text = (DEPLOY / "docker" / f"{dockerfile}.Dockerfile").read_text()
    copied = {line.split()[1] for line in text.splitlines() if line.startswith("COPY ")}
    assert packages <= copied, f"{dockerfile}.Dockerfile lacks {sorted(packages - copied)}"


@pytest.mark.parametrize("dockerfile", ["worker", "learner", "sandbox"])
def test_dockerfiles_copy_only_what_exists(dockerfile: str) -> None:
    text = (DEPLOY / "docker" / f"{dockerfile}.Dockerfile").read_text()
    sources = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    assert sources, "no COPY in image"
    for srcs in sources:
        for src in srcs:
            assert (ROOT / src).exists(), f"{dockerfile}.Dockerfile copies missing {src}"
    assert "USER" in text or dockerfile == "learner", "images run as a non-root user"


def test_nccl_override_starts_every_vllm_with_the_weight_transfer_flag() -> None:
    services = gpu_profile("nccl.override.yml")
    servers = [n for n in services if n.startswith("vllm-")]
    assert servers == [n for n in gpu_profile() if n.startswith("vllm-")]
    for name in servers:
        command = services[name]["command"]
        config = command[command.index("--weight-transfer-config") + 1]
        assert json.loads(config) == {"backend": "nccl"}
        assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    learner = services["learner"]["environment"]  # the learner pushes over those routes
    assert learner["FARM_WEIGHT_TRANSFER"] == "nccl" and "FARM_REDIS_URL" in learner
    plain = yaml.safe_load(COMPOSE.read_text())["x-vllm"]["command"]
    assert "--weight-transfer-config" not in plain and "processed_logprobs" in plain


def test_the_offline_images_pull_nothing_and_hash_what_they_copy() -> None:
    """Every FROM of the images `farm images build` makes is a build argument (the
    debootstrap base or the python image built from it), never a registry image, and
    the worker's content tag hashes exactly what its Dockerfile copies."""
    from farm.images import PROMETHEUS, PYTHON, REDIS, SOURCES, WORKER

    for image in (PYTHON, WORKER, REDIS, PROMETHEUS):
        lines = (DEPLOY / "docker" / image.dockerfile).read_text().splitlines()
        froms = [line.split()[1] for line in lines if line.startswith("FROM ")]
        assert froms and all(f in ("${BASE}", "${PYTHON_IMAGE}") for f in froms), image
    text = (DEPLOY / "docker" / WORKER.dockerfile).read_text()
    copied = {
        src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]
    }
    assert copied == set(SOURCES)
