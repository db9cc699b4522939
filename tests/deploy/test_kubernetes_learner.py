"""The learner in Kubernetes: torchrun on one GPU node, and a JobSet across several.

Each learner container's command line is read by torch's own launcher parser (the one
`python -m farm.torchrun` runs), with ``$(VAR)`` references expanded from the container's
env as the kubelet does, and what it hands to ``-m learner`` must resolve to a learner
config. On several nodes (gpu-multinode): the JobSet's indexed pods are the torchrun
nodes, node i is ``--node-rank i`` through the completion-index annotation, the master
address is pod 0's stable name from the JobSet's headless Service, ``--nnodes`` is the pod
count, ranks follow the pod's GPUs, checkpoints are on a volume every node mounts for
writing, and a config error (exit 2) or a failing run (3) fails the JobSet instead of
restarting it. With NCCL (gpu-multinode-nccl) the servers reach rank 0 at pod 0's name.
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from learner.cli import load_config
from tests.deploy.k8s import base_objects, named, render, validate


def _launch(container: dict[str, Any], example: dict[str, str]) -> tuple[Any, list[str]]:
    """torch's reading of the container's `python -m farm.torchrun ...` command line."""
    from torch.distributed.run import parse_args

    line = [*container["command"], *container.get("args", [])]
    assert line[:3] == ["python", "-m", "farm.torchrun"], line
    defined = {e["name"] for e in container.get("env", [])}

    def expand(arg: str) -> str:  # the kubelet expands $(NAME) for a variable the env defines
        return re.sub(r"\$\((\w+)\)", lambda m: example[m[1]] if m[1] in defined else m[0], arg)

    args = parse_args([expand(a) for a in line[3:]])
    assert args.module and args.training_script == "learner"
    return args, args.training_script_args


def _pod(jobset: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    return job, job["template"]["spec"]


def test_one_node_learner_runs_a_rank_per_gpu_of_its_pod() -> None:
    learner = named(base_objects(), "Deployment", "learner")["spec"]["template"]["spec"]
    args, learner_args = _launch(learner["containers"][0], {})
    assert args.standalone and args.nproc_per_node == "gpu"
    assert learner["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
    cfg = load_config([*learner_args, "--model", "/m"])
    assert cfg.resume and str(cfg.checkpoint_dir) == "/checkpoints"
    cpu = named(render("cpu"), "Deployment", "learner")["spec"]["template"]["spec"]
    assert cpu["containers"][0]["command"] == ["python", "-m", "learner"]  # no GPU to count


def test_multinode_learner_is_a_jobset_of_torchrun_nodes() -> None:
    objs = render("gpu-multinode")
    assert not [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "learner"]
    jobset = named(objs, "JobSet", "learner")
    job, pod = _pod(jobset)
    (container,) = pod["containers"]
    nodes = job["parallelism"]
    assert nodes == job["completions"] > 1 and job["completionMode"] == "Indexed"
    assert jobset["spec"]["network"]["enableDNSHostnames"]
    env = {e["name"]: e for e in container["env"]}
    index = env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    args, learner_args = _launch(container, {"NODE_RANK": "1"})
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == (str(nodes), 1, "gpu")
    subdomain = jobset["spec"]["network"].get("subdomain", jobset["metadata"]["name"])
    replicated = jobset["spec"]["replicatedJobs"][0]["name"]
    assert args.master_addr == f"{jobset['metadata']['name']}-{replicated}-0-0.{subdomain}"
    assert not args.standalone and args.rdzv_backend == "static"  # node i is rank block i
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    cfg = load_config([*learner_args, "--model", "/m"])
    assert cfg.resume and cfg.weight_transfer == "file" and cfg.metrics_port == 9102
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["checkpoints"] == str(cfg.checkpoint_dir) and mounts["shm"] == "/dev/shm"
    checkpoints = named(objs, "PersistentVolumeClaim", "farm-checkpoints")
    assert checkpoints["spec"]["accessModes"] == ["ReadWriteMany"]  # every node's shards
    gpu_learner = named(render("gpu"), "Deployment", "learner")["spec"]["template"]["spec"]
    assert container["image"] == gpu_learner["containers"][0]["image"]  # the same pin


def test_a_run_that_cannot_continue_fails_the_jobset() -> None:
    jobset = named(render("gpu-multinode"), "JobSet", "learner")
    job, pod = _pod(jobset)
    assert pod["restartPolicy"] == "Never"  # a pod failure policy needs it
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2, 3]
    assert rule["onExitCodes"]["containerName"] == pod["containers"][0]["name"]
    (fail,) = jobset["spec"]["failurePolicy"]["rules"]
    assert fail["action"] == "FailJobSet" and fail["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] > 0  # anything else: all restart


def test_jobset_validation_is_live() -> None:
    """An unknown JobSet field, and an unknown field in its pod template, are refused."""
    jobset = named(render("gpu-multinode"), "JobSet", "learner")
    validate(jobset)
    wrong = {**jobset, "spec": {**jobset["spec"], "replicatedJob": []}}
    with pytest.raises(jsonschema.ValidationError):
        validate(wrong)
    _, pod = _pod(jobset)
    pod["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(jobset)


def test_multinode_nccl_servers_reach_rank_zero_on_pod_zero() -> None:
    objs = render("gpu-multinode-nccl")
    jobset = named(objs, "JobSet", "learner")
    args, learner_args = _launch(_pod(jobset)[1]["containers"][0], {"NODE_RANK": "0"})
    cfg = load_config([*learner_args, "--model", "/m"])
    assert cfg.weight_transfer == "nccl" and cfg.transfer.master_address == args.master_addr
    vllm = named(objs, "StatefulSet", "inference")["spec"]["template"]["spec"]["containers"][0]
    assert "--weight-transfer-config" in vllm["args"]
