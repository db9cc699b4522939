"""The `/v1/completions` request subset and response shapes (vLLM's OpenAI-compatible protocol).

`parse_completion(body, limits)` turns a decoded JSON body into `GenParams` + prompt, or raises
`ProtocolError` (an HTTP 400 with a message naming the field). `completion_response(...)` builds
vLLM's `CompletionResponse` JSON: `choices[i].token_ids` / `prompt_token_ids` with
`return_token_ids`, OpenAI legacy logprobs `{tokens, token_logprobs, top_logprobs, text_offset}`,
and per-choice `weight_versions` spans `[{"version", "start", "end"}]` with
`return_weight_versions` (the shape of vLLM PR #59582). Unknown fields are ignored, as vLLM does;
fields this server cannot honour (streaming, text prompts, penalties, ...) are rejected.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from broker.messages import Sampling
from inference.openai.models import NEUTRAL_VALUES
from inference.sampling import SampleSpec
from inference.sequence import GenParams, GenRequest

Token = Annotated[StrictInt, Field(ge=0)]


class ProtocolError(Exception):
    """A bad request: becomes HTTP 400 with vLLM's error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_n: int


class CompletionRequest(BaseModel):
    """The accepted subset of vLLM's CompletionRequest; defaults follow vLLM."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str | None = None
    prompt: list[Token] = Field(min_length=1)
    n: StrictInt = Field(1, ge=1)
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: float | None = Field(1.0, ge=0.0, le=100.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    stop_token_ids: list[Token] | None = None
    allowed_token_ids: list[Token] | None = Field(None, min_length=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    return_weight_versions: StrictBool | None = None
    stream: StrictBool | None = False
    echo: StrictBool | None = False


# Fields that change sampling in vLLM, accepted only at their neutral value; this
# token-id route also refuses stop strings and the text-completion extras.
_NEUTRAL = NEUTRAL_VALUES | {"stop": (None, [], ""), "best_of": (None, 1), "suffix": (None,)}


class _Sampled(Protocol):
    """The sampling fields every request shape carries (legacy, chat and text completions)."""

    n: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop_token_ids: list[int] | None
    allowed_token_ids: list[int] | None
    ignore_eos: bool


def engine_params(req: _Sampled, max_tokens: int, top_logprobs: int) -> GenParams:
    """The engine's parameters of an already validated request; defaults follow vLLM."""
    temperature = 1.0 if req.temperature is None else req.temperature
    greedy = temperature == 0.0  # vLLM resets truncation for greedy requests only
    sampling = Sampling(
        temperature=temperature,
        top_k=0 if greedy else max(req.top_k or 0, 0),  # -1 and 0 both mean off
        top_p=1.0 if greedy else req.top_p or 1.0,
        min_p=0.0 if greedy else req.min_p or 0.0,
        allowed_token_ids=req.allowed_token_ids or None,
    )
    return GenParams(
        n=req.n,
        max_tokens=max_tokens,
        spec=SampleSpec(sampling, top_logprobs),
        seed=req.seed,
        stop_token_ids=frozenset(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def parse_completion(body: Any, limits: Limits) -> tuple[CompletionRequest, list[int], GenParams]:
    """Validate a decoded JSON body; raise ProtocolError naming the first bad field."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    if isinstance(body.get("prompt"), str) or (
        isinstance(body.get("prompt"), list)
        and body["prompt"]
        and not isinstance(body["prompt"][0], int)
    ):
        raise ProtocolError("prompt must be a single list of token ids", "prompt")
    for name in ("temperature", "top_p", "min_p"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ProtocolError(f"{name} must be a number", name)
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise ProtocolError(f"{name} is not supported by the CPU policy server", name)
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ProtocolError(f"{param}: {err['msg']}", param) from None
    if req.stream:
        raise ProtocolError("stream=true is not supported", "stream")
    if req.echo:
        raise ProtocolError("echo=true is not supported", "echo")
    if req.n > limits.max_n:
        raise ProtocolError(f"n must be at most {limits.max_n}", "n")
    for name in ("prompt", "stop_token_ids", "allowed_token_ids"):
        ids = getattr(req, name) or []
        bad = [t for t in ids if t >= limits.vocab_size]
        if bad:
            raise ProtocolError(
                f"{name} has ids outside the vocabulary (size {limits.vocab_size}): {bad[:5]}", name
            )
    if len(req.prompt) + req.max_tokens > limits.max_model_len:
        raise ProtocolError(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt has "
            f"{len(req.prompt)} and max_tokens is {req.max_tokens}",
            "max_tokens",
        )
    params = engine_params(req, req.max_tokens, req.logprobs or 0)
    return req, list(req.prompt), params


def weight_version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token labels -> ordered, contiguous half-open spans (adjacent equal labels merged)."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(versions):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


def _logprobs_block(seq, decode_one) -> dict[str, Any]:
    tokens = [decode_one(t) for t in seq.tokens]
    offsets, pos = [], 0
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    tops = [
        {decode_one(t): lp for t, lp in [(tok, lp), *top]}
        for tok, lp, top in zip(seq.tokens, seq.logprobs, seq.tops, strict=True)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(seq.logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def completion_response(
    req: CompletionRequest, gen: GenRequest, model_name: str, tokenizer: Any
) -> dict[str, Any]:
    """vLLM's CompletionResponse for a finished request."""
    choices = []
    for index, seq in enumerate(gen.seqs):
        choice: dict[str, Any] = {
            "index": index,
            "text": tokenizer.decode(seq.tokens, skip_special_tokens=req.skip_special_tokens),
            "logprobs": None,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": list(seq.tokens) if req.return_token_ids else None,
            "prompt_token_ids": list(seq.prompt) if req.return_token_ids else None,
        }
        if req.logprobs is not None:
            if req.return_tokens_as_token_ids:
                choice["logprobs"] = _logprobs_block(seq, lambda t: f"token_id:{t}")
            else:
                choice["logprobs"] = _logprobs_block(seq, lambda t: tokenizer.decode([t]))
        if req.return_weight_versions:
            choice["weight_versions"] = weight_version_spans(seq.versions)
        choices.append(choice)
    completion_tokens = sum(len(s.tokens) for s in gen.seqs)
    prompt_tokens = len(gen.seqs[0].prompt)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def error_body(
    message: str, status: int, param: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    """vLLM's ErrorResponse shape; `kind` overrides the type the status implies."""
    types = {
        400: "BadRequestError",
        401: "Unauthorized",
        404: "NotFoundError",
        409: "Conflict",
        503: "ServiceUnavailableError",
    }
    return {
        "error": {
            "message": message,
            "type": kind or types.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
