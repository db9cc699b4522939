"""`farm up` on GPU nodes, the parts that answer without a GPU: the plan and its checks.

* GPU lists ("0-3,6"), and the plan's refusals: a GPU in both lists, servers that do not
  split into tensor-parallel groups, vLLM without GPUs for the learner, given servers.
* GPU numbers are the farm's own: under CUDA_VISIBLE_DEVICES=4,5,6,7 the learner's 0-1
  are devices 4,5; a GPU that is not there is a clear error, as are a machine with no
  GPU and a missing `vllm` command.
* The learner's torchrun line parses with torch's own launcher parser: two ranks of
  ``-m learner`` whose flags (every flag LearnerConfig has) reach the learner untouched
  and resolve, with the run name from FARM_RUN, to the config the farm meant.
* The supervisor starts a start_group's servers together: a server that becomes ready only
  once its sibling is up would wait forever if they started one after the other.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path

import pytest

from farm.config import load_config
from farm.errors import ConfigError, StartupError
from farm.stack import build_stack, dry_run
from farm.supervisor import ProcessSpec, RestartPolicy, Supervisor
from launch.settings import leaves
from learner.cli import load_config as learner_config
from learner.config import LearnerConfig


def _stack(tmp_path: Path, check_machine: bool = False, **flags: object):
    cfg = load_config(None, work_dir=tmp_path, workers=1, **flags)
    model, tasks = tmp_path / "model", tmp_path / "tasks.jsonl"
    return build_stack(cfg, model, tasks, dry_run=not check_machine)


def _spec(stack, name: str) -> ProcessSpec:
    return next(s for s in stack.specs if s.name == name)


def test_gpu_lists_and_ranges(tmp_path: Path) -> None:
    stack = _stack(tmp_path, inference="vllm", inference_gpus="0-1,6", learner_gpus=["2", "3-4"])
    assert [s.name for s in stack.specs] == [
        "redis",
        "vllm-0",
        "vllm-1",
        "vllm-2",
        "learner",
        "worker-0",
    ]
    devices = [_spec(stack, f"vllm-{i}").env["CUDA_VISIBLE_DEVICES"] for i in range(3)]
    assert devices == ["0", "1", "6"]
    # only the CPU server lets the rest start while it loads: the vLLM servers still gate
    assert all(_spec(stack, f"vllm-{i}").gate_start for i in range(3))
    learner = _spec(stack, "learner")
    assert learner.env["CUDA_VISIBLE_DEVICES"] == "2,3,4"
    assert learner.argv[learner.argv.index("--nproc-per-node") + 1] == "3"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"inference_gpus": "0-3"},
            "--inference-gpus and --tensor-parallel-size need --inference vllm",
        ),
        ({"inference": "vllm", "learner_gpus": "1"}, "--inference vllm needs --inference-gpus"),
        ({"inference": "vllm", "inference_gpus": "0"}, "--inference vllm needs --learner-gpus"),
        (
            {
                "inference": "vllm",
                "inference_gpus": "0-2",
                "tensor_parallel_size": 2,
                "learner_gpus": "3",
            },
            "3 --inference-gpus do not split into servers of --tensor-parallel-size 2",
        ),
        (
            {"inference": "vllm", "inference_gpus": "0-3", "learner_gpus": "3-4"},
            "GPUs [3] are in both --inference-gpus and --learner-gpus",
        ),
        ({"learner_gpus": "0,0"}, "--learner-gpus names a GPU twice"),
        ({"learner_gpus": "3-1"}, "empty GPU range '3-1'"),
        ({"learner_gpus": "gpu0"}, "'gpu0' is not a GPU number"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_with_the_reason(
    tmp_path: Path, flags: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, work_dir=tmp_path, **flags)


def test_given_servers_and_vllm_are_one_or_the_other(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="leave out --inference-urls"):
        _stack(
            tmp_path,
            inference="vllm",
            inference_gpus="0",
            learner_gpus="1",
            inference_urls="http://a:8000",
        )


def test_gpu_numbers_index_the_farms_own_visible_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    stack = _stack(
        tmp_path,
        check_machine=True,
        learner_gpus="0-1",
        vllm_bin=sys.executable,  # stands for an installed `vllm` command (not run here)
    )
    assert _spec(stack, "learner").env["CUDA_VISIBLE_DEVICES"] == "4,5"
    with pytest.raises(StartupError, match="GPU 4 does not exist here: 4 visible"):
        _stack(tmp_path, check_machine=True, learner_gpus="3-4")


def test_a_machine_without_gpus_or_vllm_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi, no vllm (and no redis-server)
    redis = {"redis_url": "redis://127.0.0.1:6379/0"}
    with pytest.raises(StartupError, match=r"no NVIDIA GPU found.*--learner-device cpu"):
        _stack(tmp_path, check_machine=True, learner_gpus="0-1", **redis)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(StartupError, match=r"'vllm' is not on PATH.*--vllm-bin"):
        vllm = {"inference": "vllm", "inference_gpus": "0", "learner_gpus": "1"}
        _stack(tmp_path, check_machine=True, **vllm, **redis)
    # CPU ranks need neither
    stack = _stack(tmp_path, check_machine=True, learner_gpus="0-1", learner_device="cpu", **redis)
    assert "CUDA_VISIBLE_DEVICES" not in _spec(stack, "learner").env


def test_torchrun_line_reaches_the_learner_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own parser (the one `farm.torchrun` runs) reads the farm's learner line, and
    what it hands the learner resolves to what the farm meant."""
    from torch.distributed.run import parse_args

    stack = _stack(tmp_path, run="gpurun", learner_gpus="0,1", learner_device="cpu", max_steps=3)
    learner = _spec(stack, "learner")
    assert learner.argv[1:3] == ("-m", "farm.torchrun")
    args = parse_args(list(learner.argv[3:]))
    assert (args.module, args.training_script, args.nproc_per_node) == (True, "learner", "2")
    assert args.standalone and args.run_path is False
    for name, value in learner.env.items():
        monkeypatch.setenv(name, value)
    cfg = learner_config(args.training_script_args)
    assert cfg.run == "gpurun" and cfg.device == "cpu" and cfg.max_steps == 3
    assert cfg.inference_urls == list(stack.inference_urls) and cfg.resume


def test_every_learner_flag_passes_torchruns_parser() -> None:
    """torchrun's parser claims any option it knows or abbreviates, wherever it stands; a
    learner flag it would claim must travel as a variable (farm.torchrun.ENV_SETTINGS)."""
    from torch.distributed.run import parse_args

    from farm.torchrun import ENV_SETTINGS
    from launch.settings import flag

    names = [n for n in leaves(LearnerConfig) if n not in ENV_SETTINGS]
    for name in names:
        option = flag(name, leaves(LearnerConfig)[name].field)
        args = parse_args(["--standalone", "-m", "learner", option, "x"])
        assert args.training_script_args == [option, "x"], option
    with pytest.raises(SystemExit):  # why `run` is a variable: --run is torchrun's --run-path
        parse_args(["--standalone", "-m", "learner", "--run", "x"])


async def test_a_start_group_starts_together(tmp_path: Path) -> None:
    """Each server is ready only once the other has started: one after the other, the first
    would never be ready; started together, both are."""
    started = [tmp_path / "a.started", tmp_path / "b.started"]

    def server(name: str, mine: Path, other: Path) -> ProcessSpec:
        async def ready() -> bool:
            return other.exists()

        code = f"import pathlib, time; pathlib.Path({str(mine)!r}).touch(); time.sleep(60)"
        return ProcessSpec(
            name, (sys.executable, "-c", code), ready=ready, ready_timeout_s=20, start_group="g"
        )

    specs = [server("a", started[0], started[1]), server("b", started[1], started[0])]
    lines: list[str] = []
    supervisor = Supervisor(specs, lambda name, line: lines.append(line), RestartPolicy())

    async def stop_once_up(stop: asyncio.Event) -> None:
        supervisor.request_stop("both ready")

    await asyncio.wait_for(supervisor.run(stop_once_up), 30)
    assert supervisor.stop_reason == "both ready" and "all processes started" in lines


def test_dry_run_prints_a_script_and_writes_nothing(tmp_path: Path) -> None:
    work = tmp_path / "run"
    cfg = load_config(
        None, work_dir=work, workers=1, inference="vllm", inference_gpus="0", learner_gpus="1"
    )
    lines = dry_run(cfg)
    names = [line[2:] for line in lines[::2]]
    assert names == ["build-model", "redis", "vllm-0", "learner", "worker-0"]
    assert all(shlex.split(line) for line in lines[1::2])
    assert lines[5].startswith("CUDA_VISIBLE_DEVICES=0 VLLM_SERVER_DEV_MODE=1 vllm serve ")
    assert not work.exists()  # no directory, no model, no task file
