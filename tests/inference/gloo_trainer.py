"""A trainer process that dies mid-broadcast: the real peer of the transfer fault test.

`python -m tests.inference.gloo_trainer URL PORT WEIGHTS AFTER` forms the gloo group with the
server at URL, starts a push of WEIGHTS and calls `os._exit(17)` after broadcasting AFTER
tensors, from the sending thread: the process vanishes with the server mid-receive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from safetensors.torch import load_file

from inference.config import WeightSyncConfig
from inference.nccl import NcclTransport, WeightStream, gloo_trainer_init
from inference.weight_sync import NcclWeightSync


async def main(url: str, port: int, weights: Path, after: int) -> None:
    tensors = load_file(weights)

    def dying() -> Iterator[object]:
        for i, tensor in enumerate(tensors.values()):
            if i == after:
                os._exit(17)
            yield tensor

    transport = NcclTransport("127.0.0.1", port, trainer_init=gloo_trainer_init(30))
    sync = NcclWeightSync([url], WeightSyncConfig(root_dir=Path("/nonexistent")), transport)
    await sync.init()
    await sync.push(dataclasses.replace(WeightStream.of(tensors), produce=dying), version=9)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])))
    sys.exit(1)  # not reached: the push must die first
