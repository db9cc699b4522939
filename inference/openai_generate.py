"""Running OpenAI-style requests on the CPU engine: sampling parameters and watched requests.

`gen_params` turns the validated sampling fields of a chat or text completion into the
engine's `GenParams`, refusing (400) what the engine cannot honour: ids outside the vocabulary,
`n` above the server's limit, a prompt plus output longer than the context. `WatchedRequest`
is a `GenRequest` whose choices are detokenized after every engine step: a stop string ends
its sequence there (finish `stop`, `stop_reason` the string), and a shared event wakes the
handler that streams it. `generate` submits requests and waits, aborting them if the client
goes away.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from inference.engine import Engine
from inference.lora import LoraAdapter
from inference.openai.errors import ApiError
from inference.openai.models import SamplingFields
from inference.openai.render import TokenizerRenderer
from inference.openai.text import ChoiceText
from inference.protocol import Limits, engine_params
from inference.sequence import GenParams, GenRequest


def check_ids(ids: Sequence[int], limits: Limits, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(
            f"{param} has ids outside the vocabulary (size {limits.vocab_size}): {bad[:5]}", param
        )


def gen_params(
    req: SamplingFields,
    prompt_len: int,
    limits: Limits,
    max_tokens: int | None,
    top_logprobs: int,
) -> GenParams:
    """Engine parameters of one prompt; `max_tokens=None` means the rest of the context."""
    if req.n > limits.max_n:
        raise ApiError(f"n must be at most {limits.max_n}", "n")
    check_ids(req.stop_token_ids or (), limits, "stop_token_ids")
    check_ids(req.allowed_token_ids or (), limits, "allowed_token_ids")
    room = limits.max_model_len - prompt_len
    wanted = room if max_tokens is None else max_tokens
    if room < 1 or wanted > room:
        raise ApiError(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {prompt_len} and {wanted} more were asked for",
            "max_tokens",
        )
    return engine_params(req, wanted, top_logprobs)


class WatchedRequest(GenRequest):
    """A GenRequest whose choices are detokenized step by step (stop strings, streaming)."""

    def __init__(
        self,
        prompt: list[int],
        params: GenParams,
        renderer: TokenizerRenderer,
        *,
        stop: tuple[str, ...],
        skip_special_tokens: bool,
        progress: asyncio.Event,
        adapter: LoraAdapter | None = None,
    ) -> None:
        super().__init__(prompt, params, adapter)

        def decode(ids: Sequence[int]) -> str:
            return renderer.decode(ids, skip_special_tokens=skip_special_tokens)

        self.texts = [ChoiceText(decode, stop) for _ in self.seqs]
        self.progress = progress

    def stepped(self) -> None:
        for seq, text in zip(self.seqs, self.texts, strict=True):
            text.feed(seq.tokens, final=seq.finish_reason is not None)
            if text.stopped is not None and not isinstance(seq.stop_reason, str):
                seq.finish_reason, seq.stop_reason = "stop", text.stopped
        self.progress.set()

    def resolve(self, error: Exception | None = None) -> None:
        for seq, text in zip(self.seqs, self.texts, strict=True):
            text.feed(seq.tokens, final=True)  # an abort ends sequences outside a step
        super().resolve(error)
        self.progress.set()


async def generate(engine: Engine, requests: Sequence[GenRequest]) -> None:
    """Run `requests` to completion; a cancelled caller (client gone) aborts them."""
    for request in requests:
        engine.submit(request)
    try:
        await asyncio.shield(asyncio.gather(*(r.done for r in requests)))
    except asyncio.CancelledError:
        for request in requests:
            engine.abort(request)
        raise


def abort_all(engine: Engine, requests: Sequence[GenRequest]) -> None:
    for request in requests:
        if not request.done.done():
            engine.abort(request)
