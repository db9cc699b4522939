"""Exact token bookkeeping for multi-turn chat episodes, with any model's chat template.

Invariant: the token sequence an episode sends to the model is the concatenation of every
Turn's ``prompt_ids`` and ``completion_ids``, in order. The model's sampled ids are kept
verbatim (never decoded and re-tokenized). What comes between two completions (the rest of the
end-of-turn marker, the observation's messages, the generation prompt) is derived so that it
does not depend on the template leaving earlier turns alone: the observation is rendered after
a fixed base conversation (a user message and an assistant message whose content is a
sentinel), and its tokens are the template's rendering *after that assistant's content* (verl's
approach). Templates that rewrite history (Qwen3 drops the reasoning of assistant turns before
the last user message, DeepSeek-R1 drops it from every turn, Mistral moves the system prompt and
the tools to the last user message) therefore never change tokens the model already saw: the
context only grows, so the recorded trajectory is exactly what the model was fed.
(`workers.transcript` offers the other choice, the template's full rendering every turn.)

Rendering is cut around each content once per message shape (`workers.template_split`) and
checked against the template's own tokenization on sample contents, so a turn is mostly string
joins and one tokenizer call. The shapes a worker needs (the first prompt, a user observation,
a tool observation) are built when the codec is created: a template that cannot be handled
raises `TemplateError` naming it, at start-up, never at turn 2. A template with no `tool` role
(Gemma 3 raises on one) gets tool results as user messages, as Gemma's guide sends them.

Observation text keeps special-token strings as text: a sandboxed program that prints
``<|im_end|>`` puts those characters into the prompt, not a control token, so it cannot forge
turns. (`encode_region` tokenizes the region as the template would, then re-encodes as text the
stretch around any control token found inside a content.)
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from workers.errors import TemplateError
from workers.template_split import (
    PROBES,
    Joiner,
    Shape,
    build_shape,
    cache_key,
    cut,
    fill,
    joiner,
    skeleton,
)

log = logging.getLogger(__name__)

_ASSISTANT = "\ue002A\ue003"  # the base assistant's content: private-use, never in a template
_BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": _ASSISTANT})
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
)
_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
_SAMPLE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_TOOL_ID = "call00001"  # nine alphanumerics: Mistral's templates refuse any other id
_NEXT_USER = ("next", skeleton([{"role": "user", "content": ""}]))  # a text observation's key


class ChatCodec:
    """Renders an episode's conversation into exact token ids, turn by turn."""

    def __init__(
        self, tokenizer: Any, *, template_kwargs: dict[str, Any] | None = None, name: str = ""
    ) -> None:
        self._tok = tokenizer
        self.name = name or str(getattr(tokenizer, "name_or_path", "") or "the tokenizer")
        # passed to every rendering (enable_thinking, ...), so each turn is rendered alike
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self._parse = getattr(tokenizer, "_tokenizer", None)  # parses control tokens
        self._backend = _text_backend(tokenizer)  # keeps control-token strings as text
        self.stop_token_ids: tuple[int, ...] = self._stop_ids()
        self._added = frozenset(_added_ids(tokenizer))
        self._shapes: dict[Any, Shape] = {}
        self._joiners: dict[Any, Joiner | None] = {}
        self._allowed_cache: dict[tuple[str, ...], tuple[int, ...]] = {}
        self.tool_role = True
        self._tail_text, self._tail = "", []  # what follows an assistant's content
        self.end_of_turn: int | None = None  # the stop token that starts it (<|im_end|>, ...)
        try:
            self._checked("an assistant turn", self._read_tail)
            self._check()
        except TemplateError as exc:
            raise TemplateError(f"the chat template of {self.name} cannot be used: {exc}") from None

    # --- public ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of environment text; special-token strings in it stay text."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_control(self, text: str) -> list[int]:
        """Token ids of template text: control-token strings in it (`<tool_call>`) are their
        tokens, as the chat template's output is tokenized (a forced tool call's opener)."""
        return self._encode_parsed(text)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's chat template source (None: it has none)."""
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def initial_prompt(
        self, observation: Any, system_prompt: str | None, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Token ids of the first prompt: system message, tools, observation, generation prompt."""
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages = self.as_messages(observation)
        shape = skeleton(messages)
        # tools are JSON (unhashable): only a prompt with tools pays for a serialized key
        key = (
            ("first", system_prompt, shape)
            if not tools
            else cache_key("first", system_prompt, tools, shape)
        )
        return self._region(
            key,
            lambda m: self._text([*head, *m], tools, generation=True),
            lambda m: self._ids([*head, *m], tools, generation=True),
            messages,
        )

    def next_prompt(self, completion_ids: Sequence[int], observation: Any) -> list[int]:
        """Prompt-side tokens between a completion and the next one (loss mask 0)."""
        return [*self._tail_remainder(completion_ids), *self.observation_ids(observation)]

    def observation_ids(self, observation: Any) -> list[int]:
        """Tokens of `observation`'s messages after an assistant turn, generation prompt
        included; the assistant's end-of-turn marker excluded."""
        if type(observation) is str:  # the common case: one user message, a known shape
            messages: list[dict[str, Any]] = [{"role": "user", "content": observation}]
            key: Any = _NEXT_USER
        else:
            messages = self.as_messages(observation)
            key = ("next", skeleton(messages))
        return self._region(key, self._after_base, self._ids_after_base, messages)

    def render_conversation(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The template's own rendering of a whole conversation, generation prompt included."""
        return self._ids(messages, tools, generation=True)

    def as_messages(self, observation: Any) -> list[dict[str, Any]]:
        """An env observation as chat messages: text is a user message; a message dict (or a
        list of them) passes through; where the template has no tool role, tool results
        become one user message (their contents joined by newlines). Contents become strings."""
        if type(observation) is str:  # what the loop below makes of it, without the loop
            return [{"role": "user", "content": observation}]
        if isinstance(observation, dict) and "role" in observation:
            raw: list[Any] = [observation]
        elif isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
            raw = list(observation)
        else:  # a str subclass too: its content becomes a plain str below
            raw = [{"role": "user", "content": str(observation)}]
        out: list[dict[str, Any]] = []
        for m in raw:
            content = m.get("content")
            m = {**m, "content": "" if content is None else str(content)}
            if m.get("role") == "tool" and not self.tool_role:
                if out and out[-1].get("tool_result"):  # one user turn holds every result
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
                    continue
                m = {"role": "user", "content": m["content"], "tool_result": True}
            out.append(m)
        return [{k: v for k, v in m.items() if k != "tool_result"} for m in out]

    def vocab(self) -> dict[str, int]:
        """Every token's string and id, added tokens included."""
        return dict(self._tok.get_vocab())

    def allowed_token_ids(self, vocabulary: Sequence[str] | None) -> tuple[int, ...] | None:
        """Token ids of every vocabulary string plus the stop tokens; None: no restriction."""
        if not vocabulary:
            return None
        key = tuple(vocabulary)
        if key not in self._allowed_cache:
            ids = {i for word in key for i in self.encode(word)}
            self._allowed_cache[key] = tuple(sorted(ids | set(self.stop_token_ids)))
        return self._allowed_cache[key]

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """A whole chat request rendered by the template (`inference.openai.render.ChatRenderer`,
        used by the agent endpoint), the run's template kwargs under the request's; a
        template failure is a 400 `ApiError`."""
        from inference.openai.render import TokenizerRenderer

        return TokenizerRenderer(self._tok).render_messages(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs={**self.template_kwargs, **(template_kwargs or {})},
        )

    # --- start-up checks ---------------------------------------------------------------------
    def _check(self) -> None:
        """Build the shapes every worker needs, so that a template that cannot be handled
        fails here: the first prompt (alone, with a system prompt, with tools) and an
        observation after an assistant turn (a user message, a tool message)."""
        for system, tools in ((None, None), ("s", None), (None, _SAMPLE_TOOLS)):
            what = f"a first prompt (system prompt: {bool(system)}, tools: {bool(tools)})"
            self._checked(what, lambda s=system, t=tools: self.initial_prompt("x", s, t))
        self._checked("a user message after an assistant turn", lambda: self.observation_ids("x"))
        tool = {"role": "tool", "content": "x", "tool_call_id": _TOOL_ID, "name": "f"}
        try:
            self._text([*_BASE, tool], None, generation=True)
        except Exception as exc:  # the template refuses the role: results go as user messages
            log.info(
                "%s: no tool role in its template (%s); tool results go as user", self.name, exc
            )
            self.tool_role = False
        self._checked("a tool message after an assistant turn", lambda: self.observation_ids(tool))

    def _checked(self, what: str, build: Callable[[], Any]) -> None:
        try:
            build()
        except TemplateError as exc:
            raise TemplateError(f"{what}: {exc}") from None
        except Exception as exc:  # jinja errors, raise_exception() in the template
            raise TemplateError(f"{what}: {type(exc).__name__}: {exc}") from None

    # --- regions -----------------------------------------------------------------------------
    def _region(
        self,
        key: Any,
        render: Callable[[list[dict[str, Any]]], str],
        template_ids: Callable[[list[dict[str, Any]]], list[int]],
        messages: list[dict[str, Any]],
    ) -> list[int]:
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = build_shape(
                render, template_ids, self.encode_region, messages
            )
            self._joiners[key] = self._joiner(shape, template_ids, messages)
        contents = [m["content"] for m in messages]
        fast = self._joiners[key]
        if fast is not None:
            return fast.ids(contents, self.encode)
        if shape.verbatim:
            text, spans = shape.join(contents)
            return self.encode_region(text, spans)
        text = render(messages)
        found = cut(render, messages).extract(text)
        if found is None:  # a content that mimics the template's own text around it
            log.warning("%s: a content could not be located; the template tokenized it", self.name)
            return template_ids(messages)
        return self.encode_region(text, found)

    def _joiner(
        self,
        shape: Shape,
        template_ids: Callable[[list[dict[str, Any]]], list[int]],
        messages: list[dict[str, Any]],
    ) -> Joiner | None:
        """A verbatim shape's token-level cut, when it gives the template's ids on every probe
        (a tokenizer whose text encoding depends on where a chunk starts does not: then each
        turn tokenizes its whole region)."""
        if not shape.verbatim or self._parse is None or self._backend is None:
            return None
        fast = joiner(shape, self._added_spans, self._encode_parsed)
        for probe in PROBES:
            contents = [probe] * len(messages)
            if fast is None or fast.ids(contents, self.encode) != template_ids(
                fill(messages, contents)
            ):
                return None
        return fast

    def _added_spans(self, text: str) -> list[tuple[int, int]]:
        enc = self._parse.encode(text, add_special_tokens=False)
        return [
            (s, e) for tid, (s, e) in zip(enc.ids, enc.offsets, strict=True) if tid in self._added
        ]

    def encode_region(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Tokens of `text` as the template's tokenization makes them, except that control
        tokens inside a content span (an observation that prints `<|im_end|>`) stay text."""
        if self._parse is None:
            return list(self._tok.encode(text, add_special_tokens=False))
        enc = self._parse.encode(text, add_special_tokens=False)
        forged = [
            i
            for i, (tid, (s, e)) in enumerate(zip(enc.ids, enc.offsets, strict=True))
            if tid in self._added and any(a <= s and e <= b and s < e for a, b in spans)
        ]
        if not forged:
            return list(enc.ids)
        ids, pos = [], 0
        for i, (tid, (s, e)) in enumerate(zip(enc.ids, enc.offsets, strict=True)):
            if tid in self._added and i not in forged:  # the template's own control token
                ids += self.encode(text[pos:s]) if s > pos else []
                ids.append(tid)
                pos = e
        return ids + (self.encode(text[pos:]) if pos < len(text) else [])

    def _after_base(self, messages: list[dict[str, Any]]) -> str:
        """The text the template writes for `messages` after the base assistant's turn."""
        text = self._text([*_BASE, *messages], None, generation=True)
        at = text.find(_ASSISTANT)
        rest = text[at + len(_ASSISTANT) :] if at >= 0 else ""
        if at < 0 or not rest.startswith(self._tail_text):
            raise TemplateError("the assistant turn before an observation ends differently")
        return rest[len(self._tail_text) :]

    def _ids_after_base(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self._text([*_BASE, *messages], None, generation=True)
        end = text.find(_ASSISTANT) + len(_ASSISTANT) + len(self._tail_text)
        head = self._encode_parsed(text[:end])
        full = self._ids([*_BASE, *messages], None, generation=True)
        if full[: len(head)] != head:
            raise TemplateError("tokens merge across the end of an assistant turn")
        return full[len(head) :]

    # --- template rendering ------------------------------------------------------------------
    def _text(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        return self._tok.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation,
            **self.template_kwargs,
        )

    def _ids(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> list[int]:
        ids = self._tok.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=True,
            add_generation_prompt=generation,
            return_dict=False,
            **self.template_kwargs,
        )
        return list(ids)

    def _encode_parsed(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def _read_tail(self) -> None:
        """The text the template writes after an assistant message's content
        (`<|im_end|>\\n`), its tokens, and the stop token that starts it (`end_of_turn`)."""
        text = self._text(list(_BASE), None, generation=False)
        at = text.find(_ASSISTANT)
        if at < 0:
            raise TemplateError("it does not write an assistant message's content as given")
        self._tail_text = text[at + len(_ASSISTANT) :]
        self._tail = self._encode_parsed(self._tail_text)
        first = self._tail[0] if self._tail else None
        self.end_of_turn = first if first in self.stop_token_ids else None

    def _tail_remainder(self, completion: Sequence[int]) -> list[int]:
        """The part of the end-of-turn tail the model did not already generate."""
        comp = list(completion[-len(self._tail) :]) if self._tail else []
        for k in range(len(self._tail), 0, -1):
            if comp[-k:] == self._tail[:k]:
                return self._tail[k:]
        return list(self._tail)

    def _stop_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        if self._tok.eos_token_id is not None:
            ids.append(int(self._tok.eos_token_id))
        vocab = self._tok.get_vocab()
        for token in _END_OF_TURN:
            if token in vocab and vocab[token] not in ids:
                ids.append(int(vocab[token]))
        return tuple(ids)


def _text_backend(tokenizer: Any) -> Any:
    """A copy of the Rust tokenizer that encodes special-token strings as text, or None.

    A copy, because the flag is the tokenizer's own state and the chat template must
    keep parsing the special tokens it writes."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    text = Tokenizer.from_str(backend.to_str())
    text.encode_special_tokens = True
    return text


def _added_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's added tokens (special or not): the tokenizer splits text on
    them before any merge, so no merge crosses one."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i) for i in decoder}


def load_tokenizer(model_dir: str) -> Any:
    """`AutoTokenizer` of `model_dir` (local files only), without importing torch where it can.

    A worker never runs a model, and importing torch (which transformers does for any
    `AutoTokenizer` once torch is installed) costs it ~3.5 s of CPU at start and ~240 MiB of
    RSS. So while transformers is not yet imported, torch is hidden from it for the load and
    transformers sets itself up as a torch-less install does: the same tokenizer class and
    files, the tokenizers-only part of the library. The price: in this process transformers'
    models stay unavailable afterwards (torch itself imports as usual). An environment that
    runs a transformers model in the worker imports transformers (or torch) when its module
    loads (`--env-modules` load first), and the tokenizer is then loaded the usual way."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec: None; import: ImportError
    advice = os.environ.get(_NO_ADVICE)
    os.environ[_NO_ADVICE] = "1"  # not its "PyTorch was not found" advice: a worker needs none
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    finally:
        del sys.modules["torch"]
        if advice is None:
            del os.environ[_NO_ADVICE]
        else:
            os.environ[_NO_ADVICE] = advice


def load_codec(model_dir: str, template_kwargs: dict[str, Any] | None = None) -> ChatCodec:
    """Load the tokenizer of `model_dir` (`load_tokenizer`) and wrap it."""
    return ChatCodec(load_tokenizer(model_dir), template_kwargs=template_kwargs, name=model_dir)
