"""Pydantic response models in vLLM 0.33's OpenAI shapes (chat, text completions, tokenize).

Field names follow vLLM's `ChatCompletionResponse`, `ChatCompletionStreamResponse`,
`CompletionResponse`, `CompletionStreamResponse`, `TokenizeResponse` and `DetokenizeResponse`,
including its non-OpenAI extras (`stop_reason`, `token_ids`, `prompt_token_ids`) and the
project's `weight_versions` spans. Whole responses are dumped in full; stream chunks with
`exclude_unset`, as vLLM sends them, so a chunk carries only what it sets.
"""

from __future__ import annotations

import random
import time
from typing import Literal

from pydantic import BaseModel, Field


def response_id(prefix: str) -> str:
    """An opaque id in the uuid4-hex shape; it names an answer, guards nothing, so it is drawn
    from `random` rather than the OS (a system call per answer showed in the endpoint's CPU)."""
    return f"{prefix}-{random.getrandbits(128):032x}"


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int = Field(description="tokens in the prompt(s)")
    completion_tokens: int = Field(description="tokens generated over all choices")
    total_tokens: int = Field(description="their sum")


class WeightVersionSpan(BaseModel):
    """Generated tokens `[start, end)` were sampled by the weights labelled `version`."""

    version: str = Field(description="weight version label")
    start: int = Field(description="first token index")
    end: int = Field(description="one past the last token index")


class FunctionCall(BaseModel):
    """A called function: its name and JSON-encoded arguments."""

    name: str = Field(description="tool name")
    arguments: str = Field(description="arguments as a JSON object string")


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str = Field(description="call id, echoed by the tool result")
    type: Literal["function"] = Field("function", description="always `function`")
    function: FunctionCall = Field(description="the call")


class DeltaToolCall(ToolCall):
    """A tool call in a stream chunk; `index` orders the calls of one choice."""

    index: int = Field(description="position among the choice's calls")


class TopLogprob(BaseModel):
    """A token and its logprob."""

    token: str = Field(description="decoded token, or `token_id:<id>`")
    logprob: float = Field(description="raw logprob, clamped at -9999")
    bytes: list[int] | None = Field(description="UTF-8 bytes of `token`")


class LogprobEntry(TopLogprob):
    """A sampled token with the most likely alternatives at its step."""

    top_logprobs: list[TopLogprob] = Field(description="most likely tokens, best first")


class ChatLogprobs(BaseModel):
    """Chat logprobs."""

    content: list[LogprobEntry] | None = Field(description="one entry per generated token")


class ChatMessage(BaseModel):
    """The assistant's reply."""

    role: Literal["assistant"] = Field("assistant", description="always `assistant`")
    content: str | None = Field(description="text outside any tool call; None if only calls")
    tool_calls: list[ToolCall] = Field(default_factory=list, description="parsed tool calls")
    reasoning: str | None = Field(
        None, description="the reasoning split off the answer (vLLM 0.33's field; None: none)"
    )


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs."""

    tokens: list[str] = Field(description="decoded tokens")
    token_logprobs: list[float] = Field(description="raw logprob of each")
    top_logprobs: list[dict[str, float]] = Field(description="sampled plus most likely, per step")
    text_offset: list[int] = Field(description="character offset of each token")


class TokenFields(BaseModel):
    """Per-choice extras: logprobs and the project's token-level fields."""

    logprobs: ChatLogprobs | CompletionLogprobs | None = Field(None, description="logprobs")
    token_ids: list[int] | None = Field(None, description="generated ids (return_token_ids)")
    weight_versions: list[WeightVersionSpan] | None = Field(
        None, description="version spans over the generated tokens (return_weight_versions)"
    )


class ChatChoice(TokenFields):
    """One choice of a chat completion."""

    index: int = Field(description="choice number")
    message: ChatMessage = Field(description="the reply")
    finish_reason: str | None = Field(description="stop, length, tool_calls or abort")
    stop_reason: int | str | None = Field(None, description="stop token id or stop string")


class ChatCompletionResponse(BaseModel):
    """A whole chat completion."""

    id: str = Field(default_factory=lambda: response_id("chatcmpl"), description="response id")
    object: Literal["chat.completion"] = Field("chat.completion", description="kind")
    created: int = Field(default_factory=_now, description="unix time")
    model: str = Field(description="served model name")
    choices: list[ChatChoice] = Field(description="the choices")
    usage: Usage = Field(description="token counts")
    prompt_token_ids: list[int] | None = Field(None, description="prompt ids (return_token_ids)")


class ChatDelta(BaseModel):
    """What a chunk adds to a choice's message."""

    role: Literal["assistant"] | None = Field(None, description="in a choice's first chunk")
    content: str | None = Field(None, description="more text")
    reasoning: str | None = Field(None, description="the reasoning, before any content")
    tool_calls: list[DeltaToolCall] | None = Field(None, description="whole parsed calls")


class ChatStreamChoice(TokenFields):
    """A choice's part of a chunk."""

    index: int = Field(description="choice number")
    delta: ChatDelta = Field(description="what is new")
    finish_reason: str | None = Field(None, description="set on the choice's last chunk")
    stop_reason: int | str | None = Field(None, description="stop token id or stop string")


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str = Field(description="the same for every chunk of a response")
    object: Literal["chat.completion.chunk"] = Field("chat.completion.chunk", description="kind")
    created: int = Field(default_factory=_now, description="unix time")
    model: str = Field(description="served model name")
    choices: list[ChatStreamChoice] = Field(description="choices that changed (empty: usage)")
    usage: Usage | None = Field(None, description="in the final chunk with include_usage")


class CompletionChoice(TokenFields):
    """One choice of a text completion (whole, or a chunk's part)."""

    index: int = Field(description="prompt p, choice j: p * n + j")
    text: str = Field(description="generated text (or what is new in a chunk)")
    finish_reason: str | None = Field(None, description="stop, length or abort")
    stop_reason: int | str | None = Field(None, description="stop token id or stop string")
    prompt_token_ids: list[int] | None = Field(None, description="prompt ids (return_token_ids)")


class CompletionResponse(BaseModel):
    """A whole text completion, or one chunk of a streamed one (`usage` None)."""

    id: str = Field(default_factory=lambda: response_id("cmpl"), description="response id")
    object: Literal["text_completion"] = Field("text_completion", description="kind")
    created: int = Field(default_factory=_now, description="unix time")
    model: str = Field(description="served model name")
    choices: list[CompletionChoice] = Field(description="the choices")
    usage: Usage | None = Field(None, description="token counts")


class TokenizeResponse(BaseModel):
    """`/tokenize`."""

    count: int = Field(description="number of tokens")
    max_model_len: int = Field(description="the server's context limit")
    tokens: list[int] = Field(description="token ids")
    token_strs: list[str] | None = Field(None, description="vocabulary strings of the ids")


class DetokenizeResponse(BaseModel):
    """`/detokenize`."""

    prompt: str = Field(description="the decoded text")
