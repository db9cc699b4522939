"""Chat messages to prompt token ids through the model's chat template.

`ChatRenderer` is the seam: any object with `render_messages` renders a request
(`render_chat_request`). `TokenizerRenderer` implements it over a Hugging Face tokenizer (the
CPU policy server's; an endpoint that holds the same tokenizer, as the workers' `ChatCodec`
does, gets the same ids by wrapping it the same way). `template_messages` turns validated messages into the dicts
chat templates read: content parts joined into one string, and tool-call arguments decoded from
their JSON string into an object (as vLLM does), so a template may write them with `tojson`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from inference.openai.errors import ApiError
from inference.openai.models import Message


class ChatRenderer(Protocol):
    """Renders chat messages (template dicts) and tools to prompt token ids."""

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]: ...


class _ChatFields(Protocol):
    messages: list[Message]
    add_generation_prompt: bool
    chat_template_kwargs: dict[str, Any] | None

    def template_tools(self) -> list[dict[str, Any]] | None: ...


def render_chat_request(renderer: ChatRenderer, req: _ChatFields) -> list[int]:
    """Prompt ids of a chat completion or chat `/tokenize` request."""
    return renderer.render_messages(
        template_messages(req.messages),
        req.template_tools(),
        add_generation_prompt=req.add_generation_prompt,
        template_kwargs=req.chat_template_kwargs,
    )


def template_arguments(raw: str) -> Any:
    """Tool-call arguments as a template gets them: the decoded object, else the string."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw  # not JSON: the template gets the string as the client sent it
    return value if isinstance(value, dict) else raw


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Validated messages as the plain dicts a chat template iterates over."""
    out: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.reasoning is not None:  # the name chat templates read (Qwen3's)
            item["reasoning_content"] = message.reasoning
        if message.tool_calls:
            item["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": template_arguments(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        out.append(item)
    return out


class TokenizerRenderer:
    """`ChatRenderer` over a Hugging Face tokenizer that has a chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation; a template failure is a 400."""
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
                **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
            raise ApiError(f"chat template failed: {exc}", "messages") from None
        return list(ids)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of `ids` (what `/tokenize` returns as `token_strs`)."""
        return list(self.tokenizer.convert_ids_to_tokens(list(ids)))
