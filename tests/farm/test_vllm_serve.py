"""Every `vllm serve` line the project runs parses with vLLM 0.33's own CLI and means what we meant.

The lines: what `farm up --inference vllm ... --dry-run` prints (one GPU per server with NCCL
weight transfer; tensor-parallel pairs for a LoRA run with a context limit), and the vLLM
servers of deploy/ (compose's vllm-N services, with and without the NCCL override, and the
Kubernetes StatefulSet of the gpu, gpu-nccl and gpu-multinode-nccl overlays). They go to one process with the
vLLM contract environment on its path (tests/inference/vllm_contract/cli_probe.py), which
parses them as `vllm serve` does and answers with the engine arguments: model, served name,
processed logprobs, the weight-transfer backend, LoRA slots, tensor parallelism, context
limit, and the environment variables vLLM reads (`vllm.envs`). A line the parser refuses
(a LoRA rank vLLM has no buffers for) is refused there too, so the check is live.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require
from tests.inference.vllm_contract.env import VLLM_VERSION, ensure_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # importing vLLM's CLI costs about 25 s of CPU


def dry_run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "farm", "up", "--dry-run", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def commands(script: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """The dry run's commands by name: (the variables set before it, its argv)."""
    out: dict[str, tuple[dict[str, str], list[str]]] = {}
    lines = script.splitlines()
    for comment, line in zip(lines[::2], lines[1::2], strict=True):
        assert comment.startswith("# "), comment
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and not words[0].startswith(("/", "-")):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        out[comment[2:]] = (env, words)
    return out


def parse_with_vllm(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    try:
        env_dir = ensure_env()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        require(False, f"the vLLM {VLLM_VERSION} contract environment ({exc})")
        raise
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(env_dir), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "tests.inference.vllm_contract.cli_probe"],
        input=json.dumps({"cases": cases}),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def farm_lines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two dry runs' vLLM commands, and vLLM's reading of each (one probe for all)."""
    work = tmp_path_factory.mktemp("dry")
    model = work / "model"
    common = f"--work-dir {work} --model {model} --inference vllm"
    one = commands(dry_run(*f"{common} --inference-gpus 0 --learner-gpus 1".split()))
    lora_flags = "--inference-gpus 0-3 --tensor-parallel-size 2 --learner-gpus 4-7"
    lora_flags += " --lora-rank 4 --max-model-len 2048"
    lora = commands(dry_run(*f"{common} {lora_flags}".split()))
    runs = {"one": one, "lora": lora}
    servers = [(run, name) for run, cmds in runs.items() for name in cmds if "vllm" in name]
    bad = lora["vllm-0"][1].copy()
    bad[bad.index("--max-lora-rank") + 1] = "4"  # the learner's rank, not a size vLLM has
    cases = [{"argv": runs[r][n][1], "env": runs[r][n][0]} for r, n in servers]
    deployed = deploy_lines()
    parsed = parse_with_vllm([*cases, *deployed.values(), {"argv": bad, "env": {}}])
    return {
        "runs": runs,
        "model": str(model),
        "parsed": dict(zip(servers, parsed, strict=False)),
        "deployed": dict(zip(deployed, parsed[len(cases) :], strict=False)),
        "bad": parsed[-1],
    }


def deploy_lines() -> dict[tuple[str, str], dict[str, Any]]:
    """The `vllm serve` lines of deploy/: compose's vllm-N services (resolved by compose, with
    and without the NCCL override) and Kubernetes' inference StatefulSet per GPU overlay."""
    from tests.deploy.compose import gpu_profile
    from tests.deploy.k8s import named, render

    out = {}
    for variant, overrides in (("compose", ()), ("compose-nccl", ("nccl.override.yml",))):
        for name, service in gpu_profile(*overrides).items():
            if name.startswith("vllm-"):
                argv = [*service["entrypoint"], *service["command"]]
                out[(variant, name)] = {"argv": argv, "env": service["environment"]}
    for overlay in ("gpu", "gpu-nccl", "gpu-multinode-nccl"):
        sts = named(render(overlay), "StatefulSet", "inference")
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        out[("k8s-" + overlay, "inference")] = {
            "argv": [*container["command"], *container["args"]],
            "env": env,
        }
    return out


def test_one_gpu_server_with_nccl_weight_transfer(farm_lines: dict[str, Any]) -> None:
    one = farm_lines["runs"]["one"]
    assert [n for n in one if n.startswith("vllm")] == ["vllm-0"]
    env = one["vllm-0"][0]
    got = farm_lines["parsed"][("one", "vllm-0")]
    assert got["ok"], got["error"]
    engine = got["engine"]
    assert engine["model"] == farm_lines["model"]
    assert engine["served_model_name"] == ["policy"]
    assert engine["logprobs_mode"] == "processed_logprobs"
    assert engine["generation_config"] == "vllm"
    assert engine["weight_transfer_config"] == {"backend": "nccl"}
    assert engine["tensor_parallel_size"] == 1 and not engine["enable_lora"]
    assert got["frontend"]["host"] == "127.0.0.1"
    assert got["envs"] == {"VLLM_SERVER_DEV_MODE": True, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": False}
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    # the learner pushes over NCCL to that server, from its own GPU
    learner_env, learner = one["learner"]
    assert learner_env["CUDA_VISIBLE_DEVICES"] == "1"
    assert learner[learner.index("--weight-transfer") + 1] == "nccl"
    url = f"http://127.0.0.1:{got['frontend']['port']}"
    assert learner[learner.index("-m") + 1 :].count(f"--inference-urls={url}") == 1


def test_tensor_parallel_lora_servers(farm_lines: dict[str, Any]) -> None:
    lora = farm_lines["runs"]["lora"]
    names = [n for n in lora if n.startswith("vllm")]
    assert names == ["vllm-0", "vllm-1"]
    assert [lora[n][0]["CUDA_VISIBLE_DEVICES"] for n in names] == ["0,1", "2,3"]
    ports = set()
    for name in names:
        got = farm_lines["parsed"][("lora", name)]
        assert got["ok"], got["error"]
        engine = got["engine"]
        assert engine["tensor_parallel_size"] == 2
        assert engine["enable_lora"] and engine["max_lora_rank"] == 8 and engine["max_loras"] == 3
        assert engine["max_model_len"] == 2048
        assert engine["weight_transfer_config"] is None  # adapters travel as files
        assert engine["logprobs_mode"] == "processed_logprobs"
        assert got["envs"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] is True
        ports.add(got["frontend"]["port"])
    assert len(ports) == 2
    learner = lora["learner"][1]
    assert learner[learner.index("--lora-rank") + 1] == "4"
    assert "--weight-transfer" not in learner


@pytest.mark.parametrize("nccl", [False, True])
def test_deployed_servers_serve_what_the_farm_would(farm_lines: dict[str, Any], nccl: bool) -> None:
    """compose's and Kubernetes' servers: the served name, processed logprobs and vLLM's
    sampling defaults the farm's own line has, the RL routes on, NCCL where chosen."""
    deployed = farm_lines["deployed"]
    chosen = [k for k in deployed if k[0].endswith("nccl") == nccl]
    assert {k[0] for k in chosen} == (
        {"compose-nccl", "k8s-gpu-nccl", "k8s-gpu-multinode-nccl"}
        if nccl
        else {"compose", "k8s-gpu"}
    )
    for key in chosen:
        got = deployed[key]
        assert got["ok"], (key, got["error"])
        engine = got["engine"]
        assert engine["model"] == "/models/policy" and engine["served_model_name"] == ["policy"]
        assert engine["logprobs_mode"] == "processed_logprobs"
        assert engine["generation_config"] == "vllm"
        assert engine["weight_transfer_config"] == ({"backend": "nccl"} if nccl else None), key
        assert (got["frontend"]["host"], got["frontend"]["port"]) == ("0.0.0.0", 8000)
        assert got["envs"]["VLLM_SERVER_DEV_MODE"] is True, key


def test_vllm_refuses_a_line_it_cannot_serve(farm_lines: dict[str, Any]) -> None:
    assert not farm_lines["bad"]["ok"]
    assert "max-lora-rank" in farm_lines["bad"]["error"]
