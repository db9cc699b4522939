"""deploy/k8s: every manifest validates offline, overlays resolve and render.

Core kinds validate against the Kubernetes OpenAPI schemas bundled with
`kubernetes-validate` (strict: unknown fields fail). KEDA's ScaledObject and JobSet are
CRDs those schemas lack, so they validate against deploy/k8s/schemas/ (tests/deploy/k8s.py).
Overlays are rendered with `kubectl kustomize` and the rendered objects validated again.
The learner's torchrun launch (one node, and the gpu-multinode JobSet) is checked in
test_kubernetes_learner.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from learner.cli import load_config
from tests.deploy.k8s import K8S, base_objects, named, render, validate

KUSTOMIZATIONS = sorted(K8S.rglob("kustomization.yaml"))
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))


def test_every_base_manifest_validates() -> None:
    objs = base_objects()
    assert {o["kind"] for o in objs} >= {"StatefulSet", "Deployment", "ScaledObject", "Service"}
    for obj in objs:
        validate(obj)


def test_validation_catches_a_misspelt_field() -> None:
    """Strict validation is live: an unknown field in a core kind and in the CRD fails."""
    deployment = next(o for o in base_objects() if o["kind"] == "Deployment")
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = next(o for o in base_objects() if o["kind"] == "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["pendingEntries"] = "5"
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_scaled_object_scales_workers_on_the_tasks_stream() -> None:
    from broker.keys import WORKERS_GROUP, RunKeys

    objs = base_objects()
    scaled = next(o for o in objs if o["kind"] == "ScaledObject")
    config = named(objs, "ConfigMap", "farm-config")
    target = scaled["spec"]["scaleTargetRef"]["name"]
    assert any(o["kind"] == "Deployment" and o["metadata"]["name"] == target for o in objs)
    stream = RunKeys(config["data"]["FARM_RUN"]).tasks
    kinds = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis-streams"
        meta = trigger["metadata"]
        assert meta["stream"] == stream
        assert meta["consumerGroup"] == WORKERS_GROUP
        assert meta["address"].split(".")[0] == "redis-0"
        kinds |= {"lagCount", "pendingEntriesCount"} & set(meta)
    assert kinds == {"lagCount", "pendingEntriesCount"}


def test_vllm_serves_rl_routes_on_gpu_nodes() -> None:
    sts = named(base_objects(), "StatefulSet", "inference")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"][:2] == ["vllm", "serve"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu.present" in pod["nodeSelector"]


def test_inference_urls_name_every_server_pod() -> None:
    objs = base_objects()
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    sts = named(objs, "StatefulSet", "inference")
    urls = config["data"]["FARM_INFERENCE_URLS"].split(",")
    assert urls == [f"http://inference-{i}.inference:8000" for i in range(sts["spec"]["replicas"])]


def test_redis_persists_with_aof() -> None:
    sts = named(base_objects(), "StatefulSet", "redis")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_references_resolve(kustomization: Path) -> None:
    kust = yaml.safe_load(kustomization.read_text())
    refs = list(kust.get("resources", []))
    refs += [p["path"] for p in kust.get("patches", []) if "path" in p]
    refs += [f for gen in kust.get("configMapGenerator", []) for f in gen.get("files", [])]
    assert refs, "kustomization references nothing"
    for ref in refs:
        target = kustomization.parent / ref
        assert target.exists(), f"{kustomization}: {ref} does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{ref} is not a kustomization"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str) -> None:
    objs = render(overlay)
    for obj in objs:
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "rollout-farm", obj["metadata"]["name"]


def test_cpu_overlay_asks_for_no_gpu_and_runs_the_cpu_policy_server() -> None:
    text = yaml.safe_dump_all(render("cpu"))
    assert "nvidia.com/gpu" not in text
    assert "vllm" not in text
    sts = named(render("cpu"), "StatefulSet", "inference")
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["python", "-m", "inference"]


def test_vllm_is_0_33_with_temperature_scaled_logprobs_and_nccl_overlay() -> None:
    args = named(base_objects(), "StatefulSet", "inference")["spec"]["template"]["spec"]
    args = args["containers"][0]["args"]
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--weight-transfer-config" not in args  # only where NCCL is chosen
    rendered = render("gpu-nccl")
    nccl = named(rendered, "StatefulSet", "inference")["spec"]["template"]["spec"]
    nccl_args = nccl["containers"][0]["args"]
    config = nccl_args[nccl_args.index("--weight-transfer-config") + 1]
    assert json.loads(config) == {"backend": "nccl"}
    # the learner pushes over those routes, reached through the headless learner-transfer
    learner = named(rendered, "Deployment", "learner")["spec"]["template"]["spec"]["containers"][0]
    cfg = load_config([*learner["args"], "--model", "/m"])
    assert cfg.weight_transfer == "nccl" and cfg.transfer.master_address == "learner-transfer"
    service = named(rendered, "Service", "learner-transfer")["spec"]
    assert (
        service["clusterIP"] == "None" and service["ports"][0]["port"] == cfg.transfer.master_port
    )
    dockerfile = (K8S.parent / "docker" / "learner.Dockerfile").read_text()
    assert "ARG VLLM_IMAGE=vllm/vllm-openai:v0.33." in dockerfile


def test_redis_cluster_overlay_scales_on_every_partitions_tasks_stream() -> None:
    from broker.connection import RedisSettings
    from broker.keys import WORKERS_GROUP, RunKeys

    objs = render("redis-cluster")
    assert not any(o["metadata"]["name"] == "redis" for o in objs)  # no single-node Redis
    config = named(objs, "ConfigMap", "farm-config")["data"]
    assert RedisSettings.from_url(config["FARM_REDIS_URL"]).cluster
    keys = RunKeys(config["FARM_RUN"], int(config["FARM_PARTITIONS"]))
    assert keys.partitions > 1
    triggers = named(objs, "ScaledObject", "workers")["spec"]["triggers"]
    by_measure: dict[str, list[str]] = {"lagCount": [], "pendingEntriesCount": []}
    base = named(base_objects(), "ScaledObject", "workers")["spec"]["triggers"]
    base_lag = next(int(t["metadata"]["lagCount"]) for t in base if "lagCount" in t["metadata"])
    for trigger in triggers:
        assert trigger["type"] == "redis-cluster-streams"
        meta = trigger["metadata"]
        assert meta["consumerGroup"] == WORKERS_GROUP
        measure = next(m for m in by_measure if m in meta)
        by_measure[measure].append(meta["stream"])
        if measure == "lagCount":  # the base's total target, shared by the partitions
            assert int(meta["lagCount"]) == -(-base_lag // keys.partitions)
    assert all(sorted(s) == sorted(keys.all_tasks) for s in by_measure.values()), by_measure
    wrong = json.loads(json.dumps(triggers[0]))
    wrong["metadata"]["address"] = wrong["metadata"].pop("addresses")  # the one-node key
    scaled = named(objs, "ScaledObject", "workers")
    with pytest.raises(jsonschema.ValidationError):
        validate({**scaled, "spec": {**scaled["spec"], "triggers": [wrong]}})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_learner_reads_its_data_from_a_volume_not_a_config_map(overlay: str) -> None:
    """A ConfigMap caps at 1 MiB; the task and eval files live on the `farm-data` volume
    (a 100 MB Parquet file fits), and Parquet conversions go to the checkpoints volume."""
    objs = render(overlay)
    learner, deployed = _learner_pod(objs)
    args = learner["containers"][0]["args"]
    if "learner" in args:  # the JobSet's args: torchrun's, then the learner's after `-m learner`
        args = args[args.index("learner") + 1 :]
    cfg = load_config([*args, "--model", "/m"])
    mounts = {m["mountPath"]: m["name"] for m in learner["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in learner["volumes"]}
    assert cfg.tasks is not None and mounts[str(cfg.tasks.parent)] == "data"
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "farm-data"
    cache = cfg.data.dataset_cache_dir
    assert cache is not None and mounts[str(cache.parent)] == "checkpoints"
    assert named(objs, "PersistentVolumeClaim", "farm-data")
    assert not [o for o in objs if o["kind"] == "ConfigMap" and "tasks" in o["metadata"]["name"]]
    if not deployed:  # several nodes: the user puts the dataset on the shared volume first
        return
    [init] = learner["initContainers"]  # the demo's line, written only where none is
    assert init["image"] == learner["containers"][0]["image"]
    assert "[ -e /data/tasks.jsonl ] ||" in init["args"][0]


def _learner_pod(objs: list[dict]) -> tuple[dict, bool]:
    """The learner's pod spec, and whether it is the one-node Deployment (else the JobSet's)."""
    deployments = [
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "learner"
    ]
    if deployments:
        return deployments[0]["spec"]["template"]["spec"], True
    [jobset] = [o for o in objs if o["kind"] == "JobSet"]
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"], False
