"""Tool schemas from type hints and docstrings; validation of calls; ToolEnv."""

from __future__ import annotations

from typing import Literal

import pytest

import envs
from broker.messages import ErrorCategory
from envs.toolenv import ToolEnv
from envs.tools import ToolCall, ToolCallError, invoke_tool, tool, tool_schemas


class Shop(ToolEnv):
    def setup(self, seed: int | None) -> tuple[str, dict]:
        self.cart: list[str] = []
        return "Buy two apples, then checkout.", {}

    @tool
    def add(self, item: str, count: int = 1, colour: Literal["red", "green"] | None = None) -> str:
        """Put items into the cart.

        Args:
            item: What to add.
            count: How many; the cart holds
                at most ten.
            colour: Optional colour.
        """
        self.cart += [item] * count
        return f"cart has {len(self.cart)}"

    @tool
    async def checkout(self) -> str:
        """Pay and end the episode."""
        self.end_episode(1.0 if self.cart == ["apple", "apple"] else 0.0)
        return "paid"

    def helper(self) -> None:
        """Not a tool."""


def test_schema_from_hints_and_docstring() -> None:
    schemas = {s["function"]["name"]: s for s in tool_schemas(Shop())}
    assert set(schemas) == {"add", "checkout"}
    add = schemas["add"]["function"]
    assert schemas["add"]["type"] == "function"
    assert add["description"] == "Put items into the cart."
    params = add["parameters"]
    assert params["required"] == ["item"]
    assert params["properties"]["item"] == {"type": "string", "description": "What to add."}
    assert params["properties"]["count"]["type"] == "integer"
    assert params["properties"]["count"]["description"] == "How many; the cart holds at most ten."
    assert params["properties"]["colour"]["enum"] == ["red", "green"]
    assert schemas["checkout"]["function"]["parameters"]["properties"] == {}


def test_invoke_validates_arguments() -> None:
    shop = Shop()
    shop.setup(None)
    assert invoke_tool(shop, ToolCall("add", {"item": "pear", "count": "2"})) == "cart has 2"
    for call, fragment in [
        (ToolCall("fly", {}), "unknown tool 'fly'"),
        (ToolCall("add", {}), "missing a required argument"),
        (ToolCall("add", {"item": "x", "size": 3}), "unexpected keyword"),
        (ToolCall("add", {"item": "x", "count": "many"}), "bad argument 'count'"),
        (ToolCall("add", {"item": "x", "colour": "blue"}), "bad argument 'colour'"),
    ]:
        with pytest.raises(ToolCallError, match=fragment):
            invoke_tool(shop, call)


async def test_tool_env_episode_and_format_errors() -> None:
    env = Shop()
    assert len(env.tools) == 2
    obs, _ = await envs.areset(env, seed=0)
    assert "apples" in obs
    obs, reward, terminated, _, info = await envs.astep(env, "I will shop")
    assert info["error"] == ErrorCategory.FORMAT and not terminated and reward == 0.0
    obs, _, _, _, info = await envs.astep(
        env, '<tool_call>{"name": "add", "arguments": {</tool_call>'
    )
    assert info["error"] == ErrorCategory.FORMAT and obs.startswith("Error: invalid JSON")
    obs, _, _, _, info = await envs.astep(
        env, '<tool_call>{"name": "steal", "arguments": {}}</tool_call>'
    )
    assert info["error"] == ErrorCategory.FORMAT and "unknown tool" in obs
    call = '<tool_call>{"name": "add", "arguments": {"item": "apple", "count": 2}}</tool_call>'
    obs, reward, terminated, _, info = await envs.astep(env, call)
    assert obs == "cart has 2" and "error" not in info and not terminated
    codegym = '<|FunctionCallBegin|>[{"name": "checkout", "parameters": {}}]<|FunctionCallEnd|>'
    obs, reward, terminated, truncated, _ = await envs.astep(env, codegym)
    assert (obs, reward, terminated, truncated) == ("paid", 1.0, True, False)
