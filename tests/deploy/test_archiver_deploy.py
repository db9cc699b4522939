"""The archiver runs in every deployment: compose and every Kubernetes overlay.

Each archiver's command line is parsed by `python -m broker`'s own parser (a follow-mode
`archive` of a trajectories stream into the directory its volume is mounted on), it reads
the run from the same settings as the other roles, and on a partitioned run (the
redis-cluster overlay) every partition's stream has one, in the layout `farm up --archive`
writes. `farm up --archive` itself is run for real in tests/farm/test_up.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from broker.__main__ import ROLE
from broker.cli_config import BrokerCliConfig
from launch.runner import build_parser
from tests.deploy.compose import COMPOSE
from tests.deploy.k8s import K8S, base_objects, named, render
from tests.deploy.promql import DEPLOY

OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def _archive_args(argv: list[str]) -> Any:
    assert argv[:3] == ["python", "-m", "broker"], argv
    args = build_parser(ROLE).parse_args(argv[3:])
    assert args.command == "archive" and args.follow and not args.forget, argv
    return args


def test_compose_runs_a_following_archiver_onto_its_own_volume() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    archiver = doc["services"]["archiver"]
    assert "profiles" not in archiver, "replay in every deployment: both profiles run it"
    args = _archive_args(archiver["entrypoint"])
    assert args.stream == "trajectories"
    volume, mount = archiver["volumes"][0].split(":")
    assert mount == args.out and volume in doc["volumes"]
    # it reads the run the learner and workers use
    farm_env = doc["x-farm-env"]
    for key in ("FARM_REDIS_URL", "FARM_RUN"):
        assert archiver["environment"][key] == farm_env[key]
    assert set(archiver["environment"]) <= {
        f"FARM_{k.upper()}" for k in BrokerCliConfig.model_fields
    }
    # an empty named volume takes the image's ownership of the mount point: the farm user's
    dockerfile = (DEPLOY / "docker" / "worker.Dockerfile").read_text()
    assert f"install -d -o farm -g farm /weights /checkpoints {args.out}" in dockerfile


def _archivers(objs: list[dict[str, Any]]) -> dict[str, str]:
    """stream -> archive directory, over the archiver Deployment's containers."""
    deployment = named(objs, "Deployment", "archiver")
    spec = deployment["spec"]["template"]["spec"]
    claims = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    out = {}
    for container in spec["containers"]:
        args = _archive_args(container["command"])
        mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims}
        assert any(args.out == m or args.out.startswith(m + "/") for m in mounts), container
        assert container["envFrom"] == [{"configMapRef": {"name": "farm-config"}}]
        out[args.stream] = args.out
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one writer per directory
    return out


def test_kubernetes_base_runs_one_archiver_on_a_persistent_volume() -> None:
    assert _archivers(base_objects()) == {"trajectories": "/archive"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_archives_every_partition(overlay: str) -> None:
    objs = render(overlay)
    partitions = int(named(objs, "ConfigMap", "farm-config")["data"].get("FARM_PARTITIONS", 1))
    expected = {"trajectories": "/archive"}
    expected |= {f"trajectories:{p}": f"/archive/partition-{p}" for p in range(1, partitions)}
    assert _archivers(objs) == expected
