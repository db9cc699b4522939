"""The agent endpoint's streamed chat answer: OpenAI's chunk sequence for one call.

`live_chat_frames` sends a plain-text call while it is generated (`live_deltas`, which the
endpoint's streamed `/v1/responses` uses too): the role chunk at once, then content as tokens
arrive (held back where a stop string or a tool call may begin,
`inference.openai.stream`), then, once the call is generated and recorded, the closing delta
with the finish reason, the tool calls and the logprobs, usage when asked for, and `[DONE]`.
`chat_frames` sends the same sequence for a call already generated: a call read by the run's
reasoning or tool parser, or with a forced tool choice, is read whole, so its closing delta
carries everything. Content deltas concatenate to a prefix of the non-streamed content either
way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from inference.completion_stream import TokenSink
from inference.openai.errors import ApiError
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


def _opening(head: StreamHead) -> bytes:
    return sse_event(
        chat_chunk(head, [chat_stream_choice(0, ChatDelta(role="assistant", content=""))])
    )


def _content(head: StreamHead, content: str) -> bytes:
    return sse_event(chat_chunk(head, [chat_stream_choice(0, ChatDelta(content=content))]))


async def live_deltas(
    stream: ChatChoiceStream, generate: Callable[[TokenSink], Awaitable[Call]]
) -> AsyncGenerator[str | Call, None]:
    """Content deltas of `stream`'s text while `generate(sink)` runs and the sink gets its
    tokens, then the generated Call (`generate` feeds the text whole at the end). Closing the
    generator (the client went away) cancels the generation."""
    ids: list[int] = []
    woken = asyncio.Event()

    def sink(new: Sequence[int]) -> None:  # the HTTP client's callback: only hand them on
        ids.extend(new)
        woken.set()

    task = asyncio.create_task(generate(sink), name="agent-endpoint-stream")
    task.add_done_callback(lambda _: woken.set())
    try:
        while not task.done():
            await woken.wait()
            woken.clear()
            if task.done():
                break
            stream.text.feed(ids)
            content = stream.content_delta()
            if content:
                yield content
        call = task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    yield call


async def live_chat_frames(
    req: ChatCompletionRequest,
    model: str,
    stream: ChatChoiceStream,
    pieces: AsyncGenerator[str | Call, None],
) -> AsyncGenerator[bytes, None]:
    """The call as events while it is generated: `pieces` is `live_deltas(stream, ...)`."""
    head = StreamHead(model)
    yield _opening(head)
    try:
        async with contextlib.aclosing(pieces) as deltas:
            async for piece in deltas:
                if isinstance(piece, str):
                    yield _content(head, piece)
                else:
                    call = piece
    except ApiError as exc:  # after the 200 went out: an error event, as vLLM sends it
        yield sse_event(exc.body())
        yield SSE_DONE
        return
    async for frame in _closing(req, call, head, stream):
        yield frame


async def chat_frames(req: ChatCompletionRequest, call: Call) -> AsyncGenerator[bytes, None]:
    """A generated call as `chat.completion.chunk` events, ending with `[DONE]`."""
    head = StreamHead(call.model)
    yield _opening(head)
    stream = None if call.whole else ChatChoiceStream(call.text, req.parses_tools())
    async for frame in _closing(req, call, head, stream):
        yield frame


async def _closing(
    req: ChatCompletionRequest, call: Call, head: StreamHead, stream: ChatChoiceStream | None
) -> AsyncGenerator[bytes, None]:
    """Content not sent yet, the closing delta (finish reason, tool calls, the tokens'
    extras), usage when asked for, `[DONE]`; `stream` is None for a call read whole."""
    if stream is None:
        parsed = call.parsed
        calls = [DeltaToolCall(index=k, **c.model_dump()) for k, c in enumerate(parsed.tool_calls)]
        delta = ChatDelta(
            content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls or None
        )
        has_calls = bool(calls)
    else:
        content = stream.content_delta()
        if content:
            yield _content(head, content)
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
