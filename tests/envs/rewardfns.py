"""Reward functions and a toolbox that tests name on the command line (``--reward
tests.envs.rewardfns:NAME``), the way a user names theirs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from envs.tools import tool

CALLS: list[dict[str, Any]] = []  # what each reward function was called with, in this process


def length_parts(completion: str, row: dict[str, Any]) -> dict[str, float]:
    """Two named components: the reply's length (a fraction of 8 characters, capped) and
    whether the row's ``bonus`` column is set; the tiny model's replies vary in length, so
    a group's returns vary and it trains."""
    CALLS.append({"completion": completion, "row": row})
    return {"length": min(len(completion), 8) / 8, "bonus": float(bool(row.get("bonus")))}


async def async_exact(completion: str, answer: Any, messages: list[dict[str, Any]]) -> float:
    CALLS.append({"completion": completion, "answer": answer, "messages": messages})
    await asyncio.sleep(0)
    return float(completion.strip() == str(answer))


def everything(**kwargs: Any) -> float:
    CALLS.append(kwargs)
    return 0.5


def raises(completion: str) -> float:
    raise RuntimeError("the grader's database is down")


def sleeps(completion: str) -> float:
    time.sleep(1.0)
    return 1.0


def not_a_number(completion: str) -> object:
    return "yes"


def takes_nothing_known(text: str) -> float:
    return 1.0


class Calculator:
    """A toolbox for the multi-turn dataset env: built per episode with its row."""

    def __init__(self, row: dict[str, Any] | None = None) -> None:
        self.row = row

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b
