"""Tool-call parsers per model family, named as vLLM 0.33 names them (`--tool-call-parser`).

Each parser turns a model's answer text into a `ParsedAction` the way vLLM 0.33's parser of
that name does (`vllm/tool_parsers/`): on every text where vLLM finds calls, the calls (names,
arguments as JSON values, in order) and the content are vLLM's, and where vLLM finds none,
none are found here. Unlike vLLM, which hands a malformed attempt back as plain content, a
text that attempts a call in the family's syntax and fails sets `error`, so the environment
feeds the mistake back to the model (`ErrorCategory.FORMAT`); tests/inference/vllm_contract
runs vLLM's own parsers on the same texts.

| name | format | families |
|---|---|---|
| `hermes`, `qwen3_json` | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` | Qwen2.5, Qwen3, DeepSeek-R1-Distill-Qwen, SmolLM2 |
| `llama3_json` | `{"name": ..., "parameters": {...}}` (`<|python_tag|>` optional) | Llama 3.1/3.2 |
| `mistral` | `[TOOL_CALLS] [{"name": ..., "arguments": {...}}]` (pre-v11) | Mistral v3 |
| `pythonic` | `[f(a=1), g(b="x")]` | Gemma 3, Llama 3.2 pythonic |

Mistral's calls get a 9-character alphanumeric id (its template refuses others); the others
`call_<24 hex>`. Ids are drawn from a seeded generator per parse, so a re-run is identical.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from envs.tools import ToolCall

# (calls, content, error); content None: the text held only calls
Parse = tuple[list[ToolCall], str | None, str | None]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_PYTHONIC = re.compile(
    r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
    r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]",
    re.DOTALL,
)
_MISTRAL_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)
_TOOL_CALLS = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
_JSON_NAMES = {"null": None, "true": True, "false": False}
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


class _Malformed(ValueError):
    """A call attempt that vLLM's parser rejects as a whole."""


def _ids(text: str, mistral: bool) -> Callable[[int], str]:
    seed = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def make(index: int) -> str:
        digest = hashlib.sha256(seed + index.to_bytes(4, "little")).digest()
        if mistral:
            return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])
        return "call_" + digest.hex()[:24]

    return make


def _calls(text: str, found: list[tuple[str, Any]], *, mistral: bool = False) -> list[ToolCall]:
    make = _ids(text, mistral)
    return [ToolCall(name, args, id=make(i)) for i, (name, args) in enumerate(found)]


def hermes(text: str) -> Parse:
    """vLLM's `hermes` (`Hermes2ProToolParser`): every `<tool_call>` block, the last one may
    be unclosed; each must be a JSON object with `name` and `arguments`; the content is the
    text before the first block."""
    if "<tool_call>" not in text:
        return [], text, None
    found = []
    for closed, unclosed in _HERMES.findall(text):
        try:
            obj = json.loads(closed or unclosed)
            found.append((_name(obj["name"]), obj["arguments"]))
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            return [], text, f"malformed <tool_call>: {_reason(exc)}"
    content = text[: text.find("<tool_call>")]
    return _calls(text, found), content or None, None


def llama3_json(text: str) -> Parse:
    """vLLM's `llama3_json`: every top-level `{...}` of the text must be a JSON object with a
    `name` and `arguments` (or `parameters`); then all of them are the calls and there is
    no content."""
    if _PYTHON_TAG not in text and "{" not in text:
        return [], text, None
    decoder = json.JSONDecoder()
    found: list[tuple[str, Any]] = []
    end = -1
    try:
        for match in re.finditer(r"\{", text):
            if match.start() <= end:
                continue
            obj, length = decoder.raw_decode(text[match.start() :])
            end = match.start() + length
            args = obj["arguments"] if "arguments" in obj else obj["parameters"]
            found.append((_name(obj["name"]), args))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        attempted = text.lstrip().startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG in text
        return [], text, f"malformed JSON tool call: {_reason(exc)}" if attempted else None
    if not found:
        return [], text, None
    return _calls(text, found), None, None


def mistral(text: str) -> Parse:
    """vLLM's `mistral` for pre-v11 tokenizers: the JSON after `[TOOL_CALLS]` (an object or
    a list of them; entries without `name` or `arguments` are skipped), content before it."""
    if _TOOL_CALLS not in text:
        return [], text, None
    content, *segments = text.split(_TOOL_CALLS)
    body = next((s.strip() for s in segments if s.strip()), "")
    try:
        parsed, _ = json.JSONDecoder().raw_decode(body)
    except (ValueError, RecursionError):
        try:
            parsed = json.loads(_MISTRAL_ARRAY.findall(body)[0])
        except (IndexError, ValueError, RecursionError) as exc:
            return [], body, f"malformed [TOOL_CALLS] JSON: {_reason(exc)}"
    entries = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    found = []
    for entry in entries:
        if not isinstance(entry, dict) or not ("name" in entry or "arguments" in entry):
            continue
        name = entry.get("name")
        args = entry.get("arguments")
        args = {} if args is None else _json_string(args) if isinstance(args, str) else args
        found.append((name if isinstance(name, str) else "", args))
    if not found:
        return [], body, "no tool call in the JSON after [TOOL_CALLS]"
    return _calls(text, found, mistral=True), content if content.strip() else None, None


def _json_string(args: str) -> Any:
    """vLLM keeps a string `arguments` as the JSON text itself; here it is that text's value
    (the same JSON on the wire), or the string when it is not JSON."""
    try:
        return json.loads(args) if args.strip() else {}
    except (ValueError, RecursionError):
        return args


def pythonic(text: str) -> Parse:
    """vLLM's `pythonic`: the whole text is a Python list of calls with keyword arguments
    whose values are literals (JSON's null/true/false too); positional arguments are
    ignored, as vLLM ignores them."""
    if _PYTHONIC.match(text) is None:
        attempted = text.lstrip().startswith("[") and "(" in text
        return [], text, "malformed pythonic tool call list" if attempted else None
    try:
        body = ast.parse(text).body
        value = getattr(body[0], "value", None) if body else None
        if not isinstance(value, ast.List) or not all(isinstance(e, ast.Call) for e in value.elts):
            raise _Malformed("a tool call list must hold only calls")
        found = [(_dotted(call.func), _keywords(call)) for call in value.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return [], text, f"malformed pythonic tool call: {_reason(exc)}"
    return _calls(text, found), None, None


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise _Malformed("a tool name must be a name")
    return ".".join([node.id, *reversed(parts)])


def _keywords(call: ast.Call) -> dict[str, Any]:
    # `**x` has no name: vLLM keys it None, which JSON writes as "null"
    return {"null" if kw.arg is None else kw.arg: _literal(kw.value) for kw in call.keywords}


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, str | int | float):
            return node.value
        raise _Malformed("arguments must be JSON values")
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise _Malformed("dict keys must be literals")
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_literal(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _literal(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise _Malformed("arguments must be literals")


def _name(value: Any) -> str:
    if not isinstance(value, str):  # vLLM's FunctionCall model refuses it, and the whole parse
        raise _Malformed(f"a tool name must be a string, got {type(value).__name__}")
    return value


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc}"
    return f"{type(exc).__name__}: {str(exc)[:120]}"


PARSERS: dict[str, Callable[[str], Parse]] = {
    "hermes": hermes,
    "qwen3_json": hermes,  # vLLM 0.33 aliases it to Hermes2ProToolParser
    "llama3_json": llama3_json,
    "llama4_json": llama3_json,
    "mistral": mistral,
    "pythonic": pythonic,
}
# parsers that read the text with special tokens kept, as vLLM's adjust_request asks
KEEPS_SPECIAL_TOKENS = frozenset({"hermes", "qwen3_json", "mistral"})
