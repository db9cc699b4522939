"""Pydantic request models of `/v1/chat/completions`, `/tokenize` and `/detokenize`.

Field names and defaults follow vLLM 0.33's `ChatCompletionRequest`, `TokenizeCompletionRequest`,
`TokenizeChatRequest` and `DetokenizeRequest`; unknown fields are ignored, as vLLM does. Fields
that change sampling in ways no endpoint of this project implements (penalties, beam search,
structured outputs (`response_format` with a schema), ...) are refused unless they hold their
neutral value, so a client never gets silently different sampling than it asked for. A forced
`tool_choice` (`required`, or a named function) is accepted here; each endpoint enforces it
(`inference.openai.tool_choice`) or refuses it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from inference.openai.errors import ApiError

_INT64 = 2**63 - 1

# Fields that change sampling in vLLM; accepted only at a neutral value.
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None,),
    "min_tokens": (None, 0),
    "echo": (None, False),
    "continue_final_message": (None, False),
    "structured_outputs": (None,),
    "logprob_token_ids": (None, []),
    "bad_words": (None, []),
    "response_format": (None, {"type": "text"}),
}


def refuse_non_neutral(body: dict[str, Any], names: dict[str, tuple[Any, ...]]) -> None:
    """Raise a 400 naming the first field that is set to a value this server cannot honour."""
    for name, neutral in names.items():
        if name in body and body[name] not in neutral:
            raise ApiError(f"{name} is not supported by this server", name)


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class FunctionCall(_Model):
    """The function of an assistant's earlier tool call."""

    name: str = Field(description="name of the called tool")
    arguments: str = Field(description="the arguments as a JSON-encoded object")


class ToolCallParam(_Model):
    """One tool call of an assistant message in the history."""

    id: str | None = Field(None, description="call id, echoed by the tool message")
    type: Literal["function"] = Field("function", description="always `function`")
    function: FunctionCall = Field(description="the called function")


class TextPart(_Model):
    """A text content part; other part types (images, audio) are refused."""

    type: Literal["text"] = Field(description="`text` (the only part type accepted)")
    text: str = Field(description="the text")


class Message(_Model):
    """One chat message (`system`, `developer`, `user`, `assistant` or `tool`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="who speaks"
    )
    content: str | list[TextPart] | None = Field(None, description="text, or text parts")
    name: str | None = Field(None, description="optional participant name")
    tool_calls: list[ToolCallParam] | None = Field(None, description="an assistant's tool calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    reasoning: str | None = Field(
        None,
        description="an assistant's reasoning, as the server returned it (also read from "
        "`reasoning_content`); templates that show reasoning (Qwen3) get it",
        validation_alias=AliasChoices("reasoning", "reasoning_content"),
    )

    @model_validator(mode="after")
    def _needs_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Model):
    """A tool's function schema."""

    name: str = Field(min_length=1, description="function name")
    description: str | None = Field(None, description="what it does")
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments")
    strict: bool | None = Field(None, description="OpenAI strict mode flag (passed through)")


class ToolParam(_Model):
    """A tool offered to the model."""

    type: Literal["function"] = Field("function", description="always `function`")
    function: FunctionDefinition = Field(description="the function")


class NamedFunction(_Model):
    """The function a named tool choice forces."""

    name: str = Field(min_length=1, description="a function among `tools`")


class NamedToolChoice(_Model):
    """`tool_choice` naming one function (vLLM's ChatCompletionNamedToolChoiceParam)."""

    type: Literal["function"] = Field("function", description="always `function`")
    function: NamedFunction = Field(description="the forced function")


class StreamOptions(_Model):
    """`stream_options` of a streaming request."""

    include_usage: bool | None = Field(False, description="send a final chunk with usage")
    continuous_usage_stats: bool | None = Field(False, description="usage on every chunk")


class SamplingFields(_Model):
    """The sampling and output fields that chat completions and text completions share."""

    model: str | None = Field(None, description="served model name (None: the served one)")
    n: int = Field(1, ge=1, description="choices to sample")
    max_tokens: int | None = Field(None, ge=1, description="most tokens to generate")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 means greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus mass")
    top_k: int | None = Field(None, ge=-1, description="keep the k most likely tokens (0, -1: off)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="drop below min_p x the top")
    seed: int | None = Field(None, ge=0, le=_INT64, description="choice i draws from seed + i")
    stop: str | list[str] | None = Field(None, description="stop strings (cut from the text)")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end a choice")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="token mask")
    ignore_eos: bool = Field(False, description="keep generating past EOS")
    skip_special_tokens: bool = Field(True, description="drop special tokens from the text")
    stream: bool | None = Field(False, description="answer as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="streaming options")
    return_token_ids: bool | None = Field(None, description="add prompt and completion ids")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="logprob tokens as `token_id:<id>`"
    )
    return_weight_versions: bool | None = Field(
        None, description="per-choice weight version spans over the generated tokens"
    )

    def stop_strings(self) -> tuple[str, ...]:
        """The non-empty stop strings, as a tuple."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return tuple(s for s in stops if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk: `continuous_usage_stats` together with `include_usage`."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)


def _check_tools_and_stream(data: dict[str, Any]) -> None:
    """vLLM's cross-field rules: no empty `tools`, no tool_choice without tools, and
    `stream_options` only with `stream`."""
    if data.get("tools") == []:
        raise ApiError("tools must not be an empty array; omit the field instead", "tools")
    if data.get("tool_choice") not in (None, "none") and not data.get("tools"):
        raise ApiError("tool_choice needs tools", "tool_choice")
    if data.get("stream_options") is not None and not data.get("stream"):
        raise ApiError("stream_options can only be given with stream=true", "stream_options")


def _check_named_choice(data: dict[str, Any]) -> None:
    """A named tool choice must name one of the offered tools (vLLM refuses it too)."""
    choice = data.get("tool_choice")
    if not isinstance(choice, dict) or not isinstance(data.get("tools"), list):
        return
    name = (choice.get("function") or {}).get("name")
    offered = {(t.get("function") or {}).get("name") for t in data["tools"] if isinstance(t, dict)}
    if name not in offered:
        raise ApiError(f"tool_choice names {name!r}, which is not among tools", "tool_choice")


class ChatCompletionRequest(SamplingFields):
    """The accepted subset of vLLM's ChatCompletionRequest."""

    messages: list[Message] = Field(min_length=1, description="the conversation")
    tools: list[ToolParam] | None = Field(None, description="tools the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="`auto` (default with tools), `none`, `required` or a named function"
    )
    max_completion_tokens: int | None = Field(
        None, ge=1, description="most tokens to generate (wins over max_tokens)"
    )
    logprobs: bool | None = Field(False, description="return the sampled tokens' logprobs")
    top_logprobs: int | None = Field(0, ge=0, le=20, description="most likely tokens per step")
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant cue")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template"
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_non_neutral(data, NEUTRAL_VALUES)
            _check_named_choice(data)
            if data.get("top_logprobs") and not data.get("logprobs"):
                raise ApiError("top_logprobs needs logprobs=true", "top_logprobs")
            _check_tools_and_stream(data)
        return data

    def output_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (the rest of the context)."""
        return self.max_completion_tokens or self.max_tokens

    def parses_tools(self) -> bool:
        """Tool calls are parsed when tools are offered and tool_choice is not `none`."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template expects them (OpenAI tool dicts)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


class TokenizeCompletionRequest(_Model):
    """`/tokenize` with a text prompt."""

    model: str | None = Field(None, description="served model name")
    prompt: str = Field(description="text to tokenize")
    add_special_tokens: bool = Field(True, description="add BOS and the like")
    return_token_strs: bool | None = Field(False, description="also return the token strings")


class TokenizeChatRequest(_Model):
    """`/tokenize` with chat messages (rendered through the chat template)."""

    model: str | None = Field(None, description="served model name")
    messages: list[Message] = Field(description="the conversation")
    tools: list[ToolParam] | None = Field(None, description="tools rendered into the prompt")
    add_generation_prompt: bool = Field(True, description="end with the assistant cue")
    continue_final_message: bool = Field(False, description="refused when true")
    add_special_tokens: bool = Field(False, description="add BOS on top of the template")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="template variables")
    return_token_strs: bool | None = Field(False, description="also return the token strings")

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TextCompletionRequest(SamplingFields):
    """`/v1/completions` with text prompts, batches or streaming (vLLM's CompletionRequest)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts, token ids, or lists of token ids"
    )
    max_tokens: int | None = Field(16, ge=1, description="most tokens to generate (vLLM: 16)")
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs per token")
    add_special_tokens: bool = Field(True, description="add BOS and the like to text prompts")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_non_neutral(data, NEUTRAL_VALUES | {"suffix": (None, ""), "best_of": (None, 1)})
            if data.get("stream_options") is not None and not data.get("stream"):
                raise ApiError(
                    "stream_options can only be given with stream=true", "stream_options"
                )
        return data


class DetokenizeRequest(_Model):
    """`/detokenize`."""

    model: str | None = Field(None, description="served model name")
    tokens: list[Annotated[int, Field(ge=0, le=_INT64)]] = Field(description="ids to decode")
