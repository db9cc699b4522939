"""The agent endpoint's streamed chat answer: OpenAI's chunk sequence for one generated call.

`chat_frames` yields the SSE frames of a call the endpoint has generated and recorded
(`workers.agent_endpoint`): the role chunk, the content (held back where a tool call may begin,
`inference.openai.stream`), the closing delta with the finish reason and the tool calls, usage
when asked for, then `[DONE]`. A call read by the run's reasoning or tool parser, or with a
forced tool choice, is read whole, so its closing delta carries everything.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from inference.openai.models import ChatCompletionRequest
from inference.openai.responses import (
    Generated,
    OutputFormat,
    StreamHead,
    chat_chunk,
    chat_finish_reason,
    chat_stream_choice,
    usage,
    usage_chunk,
)
from inference.openai.schema import ChatDelta, DeltaToolCall
from inference.openai.sse import SSE_DONE, sse_event
from inference.openai.stream import ChatChoiceStream
from inference.openai.text import ChoiceText
from inference.openai.tools import ParsedMessage


@dataclass(frozen=True)
class Call:
    """One generated call, as both the JSON and the streamed answer are built from it."""

    model: str  # the name the answer carries
    prompt: list[int]  # the prompt ids the call was generated from
    generated: Generated  # its tokens, logprobs and weight versions
    text: ChoiceText  # its detokenized text, fed whole
    reason: str  # finish reason: `stop` when a stop string ended it
    parsed: ParsedMessage  # reasoning, content and tool calls, read with the run's parsers
    fmt: OutputFormat  # what of the tokens the request asked to see
    whole: bool  # read whole (a parser or a forced tool choice): one delta carries it


async def chat_frames(req: ChatCompletionRequest, call: Call) -> AsyncGenerator[bytes, None]:
    """The call as `chat.completion.chunk` events, ending with `[DONE]`."""
    head = StreamHead(call.model)
    opening = chat_stream_choice(0, ChatDelta(role="assistant", content=""))
    yield sse_event(chat_chunk(head, [opening]))
    if call.whole:
        parsed = call.parsed
        calls = [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(parsed.tool_calls)]
        delta = ChatDelta(
            content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls or None
        )
        has_calls = bool(calls)
    else:
        stream = ChatChoiceStream(call.text, req.parses_tools())
        content = stream.content_delta()
        if content:
            yield sse_event(chat_chunk(head, [chat_stream_choice(0, ChatDelta(content=content))]))
        delta, has_calls = stream.final_delta()
    closing = chat_stream_choice(
        0,
        delta,
        call.generated,
        call.fmt,
        finish_reason=chat_finish_reason(call.reason, has_calls),
        stop_reason=None,
    )
    yield sse_event(chat_chunk(head, [closing]))
    if req.include_usage():
        counts = usage(len(call.prompt), len(call.generated.token_ids))
        yield sse_event(usage_chunk(head, counts))
    yield SSE_DONE
