"""The learner under torchrun: its command line, and torchrun keeping the ranks' exit status.

`learner_command` renders ``python -m farm.torchrun --standalone --nproc-per-node N -m learner
FLAGS``: one rank per GPU of ``--learner-gpus`` on this node. torchrun's parser takes every
option it knows, or abbreviates, wherever it stands: ``--run`` after ``-m learner`` is read
as torchrun's ``--run-path`` (an error). So the run name travels as ``FARM_RUN`` (the
learner reads it like the flag), and tests/farm/test_torchrun.py checks with torch's own
parser that every other learner flag reaches the learner untouched.

``python -m farm.torchrun ARGS`` is torch's own launcher (`torch.distributed.run`, the same
parser and elastic agent as ``torchrun``) with one difference: when a rank fails, it exits
with that rank's status (the first to fail) instead of torchrun's 1, so the supervisor sees
the learner's 2 (bad config or dataset) or 3 (the run cannot progress) and stops the farm
rather than restarting a learner that would fail again. torch is imported only when it runs.
"""

from __future__ import annotations

import signal
import sys

# Learner settings given as FARM_* variables, not flags: torchrun's parser would take them.
ENV_SETTINGS = ("run",)
# torchrun's grace for the ranks after a SIGTERM before it kills them (default 30 s): rank 0
# may be writing a checkpoint. The supervisor waits longer (the learner's stop_timeout_s).
SHUTDOWN_GRACE_S = 50


def learner_command(
    python: str, nproc: int, flags: list[str], run: str
) -> tuple[tuple[str, ...], dict[str, str]]:
    """(argv, env) running ``python -m learner FLAGS`` as `nproc` ranks under torchrun.

    `flags` are the learner's rendered flags; its ``--run NAME`` moves into the environment.
    """
    kept: list[str] = []
    rest = iter(flags)
    for flag in rest:
        if flag == "--run":
            next(rest)  # the name: given as FARM_RUN below
        elif not flag.startswith("--run="):
            kept.append(flag)
    argv = (python, "-m", "farm.torchrun", "--standalone", "--nproc-per-node", str(nproc))
    env = {"FARM_RUN": run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_GRACE_S)}
    return (*argv, "-m", "learner", *kept), env


def main(argv: list[str] | None = None) -> int:
    """torch.distributed.run with the first failed rank's exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        print(exc, file=sys.stderr)  # torchrun's own summary of which rank failed and how
        _, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:  # the farm stopping: the ranks got the signal too
        return 128 + signal.Signals(exc.sigval).value
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
