"""The trainer side's rank layout and NcclTransport's bodies (the transfer itself: vllm_contract)."""

from __future__ import annotations

import pytest

from inference.nccl import NcclTransport, WeightStream, rank_offsets


def test_servers_take_consecutive_rank_blocks_behind_the_trainer() -> None:
    # TP=2; PP=2 x DP=2; one GPU: workers 1-2, 3-6, 7; trainer 0
    assert rank_offsets([2, 4, 1]) == ([1, 3, 7], 8)
    with pytest.raises(ValueError):
        rank_offsets([2, 0])


def test_init_info_carries_packed_only_when_packing() -> None:
    plain = NcclTransport("10.0.0.5", 29600).init_info(3, 8)
    assert plain == {
        "master_address": "10.0.0.5",
        "master_port": 29600,
        "rank_offset": 3,
        "world_size": 8,
    }
    packed = NcclTransport("10.0.0.5", 29600, packed=True).init_info(1, 2)
    assert packed["packed"] is True and packed["packed_num_buffers"] == 2


async def test_send_before_the_group_is_formed_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not formed"):
        await NcclTransport("127.0.0.1", 1).send(WeightStream.of({}))
