"""Exact token bookkeeping for multi-turn chat episodes.

Invariant: the token sequence an episode sends to the model is the concatenation of
every Turn's ``prompt_ids`` and ``completion_ids``, in order. The model's sampled ids
are reused verbatim (never decoded and re-tokenized); everything between two
completions — the rest of the end-of-turn marker, the observation message and the
generation prompt — is the *token diff* of the chat template rendered with
``apply_chat_template(..., tokenize=True)`` before and after the observation.

Rendering a template costs ~0.6 ms, so the diff is computed once per template shape
with a sentinel observation and cached as ``head + tokens(before + observation + after) +
tail``, where ``before``/``after`` are the template text sharing a tokenizer chunk with the
observation (BPE merges across that boundary: ChatML's ``user\n`` + ``  x``). The
cached form is checked against the full template diff on sample observations when it
is built; a template whose diff does not split that way (it rewrites content, merges
tokens across the boundary) uses the full rendering on every turn instead.

Text from environments is encoded with special tokens as plain text: an observation
that prints ``<|im_end|>`` (a sandboxed program can) gets the characters, not the
control token, so it cannot forge turns of the conversation. (A template rendered in
full, the fallback above, would still parse them: use templates that split.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.errors import TemplateError

_SENTINEL = "\ue000OBS\ue001"  # private-use characters: never in a real template
_PROBES = (
    "7",
    "hello world",
    " leading and trailing \n",
    "a\n\nb:{}<>",
    "ünïcödé ✓",
    "  two spaces",
    "\n\nnewlines first",
    "12345 ",
    "\t",
)
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


@dataclass(frozen=True)
class _Split:
    """A template's rendering of one observation, cut around it: `head` + tokens of
    (`before` + observation + `after`) + `tail`. `before`/`after` are the template's text
    that shares a tokenizer chunk with the observation (no added token in between)."""

    head: list[int]
    before: str
    after: str
    tail: list[int]


class ChatCodec:
    """Renders an episode's conversation into exact token ids, turn by turn."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._backend = _text_backend(tokenizer)
        self.stop_token_ids: tuple[int, ...] = self._stop_ids()
        self._tail = self._assistant_tail()
        self._added = frozenset(_added_ids(tokenizer))
        self._obs_cache: dict[str, _Split | None] = {}
        self._first_cache: dict[tuple[str | None, str], _Split | None] = {}
        self._allowed_cache: dict[tuple[str, ...], tuple[int, ...]] = {}

    # --- public ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of environment text; special-token strings in it stay text."""
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def initial_prompt(
        self, observation: Any, system_prompt: str | None, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Token ids of the first prompt: system message, tools, observation, generation prompt."""
        head = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if not isinstance(observation, str):
            return self._render([*head, *as_messages(observation)], tools, generation=True)
        key = (system_prompt, json.dumps(tools, sort_keys=True) if tools else "")
        if key not in self._first_cache:
            self._first_cache[key] = self._split(lambda m: self._render([*head, *m], tools, True))
        split = self._first_cache[key]
        if split is None:
            return self._render([*head, *as_messages(observation)], tools, generation=True)
        return self._join(split, observation)

    def next_prompt(self, completion_ids: Sequence[int], observation: Any) -> list[int]:
        """Prompt-side tokens between a completion and the next one (loss mask 0)."""
        rest = self._tail_remainder(completion_ids)
        if not isinstance(observation, str):
            return [*rest, *self._observation_diff(as_messages(observation))]
        if "user" not in self._obs_cache:
            self._obs_cache["user"] = self._split(self._observation_diff)
        split = self._obs_cache["user"]
        if split is None:
            return [*rest, *self._observation_diff(as_messages(observation))]
        return [*rest, *self._join(split, observation)]

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
        used by the agent endpoint); a template failure is a 400 `ApiError`."""
        from inference.openai.render import TokenizerRenderer

        return TokenizerRenderer(self._tok).render_messages(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )

    # --- template rendering ------------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> list[int]:
        ids = self._tok.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=True,
            add_generation_prompt=generation,
            return_dict=False,
        )
        return list(ids)

    def _observation_diff(self, observation: list[dict[str, Any]]) -> list[int]:
        """Template diff for appending `observation` after an assistant turn."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = self._render(base, None, generation=False)
        after = self._render([*base, *observation], None, generation=True)
        if after[: len(before)] != before:
            raise TemplateError("chat template does not extend the conversation by appending")
        return after[len(before) :]

    def _split(self, render: Any) -> _Split | None:
        """Split render(sentinel observation) around the observation, or None when that split
        does not reproduce the template on every probe.

        The text between the nearest added tokens on either side (ChatML: `user\\n` before,
        nothing after) is kept as text and encoded together with each observation, because a
        BPE tokenizer merges across that boundary (`\\n` + `  x` is not `\\n`, `  x`)."""
        sentinel = self.encode(_SENTINEL)
        full = render(as_messages(_SENTINEL))
        at = _find(full, sentinel)
        if at < 0:
            return None
        end = at + len(sentinel)
        lo = max((i + 1 for i in range(at) if full[i] in self._added), default=0)
        hi = next((i for i in range(end, len(full)) if full[i] in self._added), len(full))
        split = _Split(
            full[:lo],
            self.decode(full[lo:at], skip_special=False),
            self.decode(full[end:hi], skip_special=False),
            full[hi:],
        )
        for probe in _PROBES:
            if render(as_messages(probe)) != self._join(split, probe):
                return None
        return split

    def _join(self, split: _Split, observation: str) -> list[int]:
        return [*split.head, *self.encode(split.before + observation + split.after), *split.tail]

    def _assistant_tail(self) -> list[int]:
        """Tokens the template writes after an assistant message's content (e.g. <|im_end|>\\n)."""
        user = [{"role": "user", "content": "x"}]
        a = self._render([*user, {"role": "assistant", "content": "a"}], None, generation=False)
        b = self._render([*user, {"role": "assistant", "content": "b"}], None, generation=False)
        n = 0
        while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
            n += 1
        return a[len(a) - n :] if n else []

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


def as_messages(observation: Any) -> list[dict[str, Any]]:
    """An env observation as chat messages: text is a user message; a message dict (or a
    list of them) passes through."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict) and "role" in observation:
        return [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) for m in observation):
        return list(observation)
    return [{"role": "user", "content": str(observation)}]


def _find(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return -1


def load_codec(model_dir: str) -> ChatCodec:
    """Load the tokenizer of `model_dir` (local files only) and wrap it."""
    from transformers import AutoTokenizer

    return ChatCodec(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
