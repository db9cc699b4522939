"""A forced `tool_choice` (`required`, or a named function), enforced by its first tokens.

vLLM 0.33 enforces a forced choice with guided decoding: the completion is constrained to a
JSON schema (an array of `{name, parameters}` for `required`, the function's parameters for a
named one) and turned into tool calls (`vllm/tool_parsers/utils.py`,
`get_json_schema_from_tools`). This project's servers have no guided decoding, so they force
the start of the model's own call syntax instead: the completion is generated after the
opener of a Hermes/Qwen call, `<tool_call>\\n{"name": "`, and for a named function after its
name and `"arguments": ` too. What follows is sampled freely: the model chooses the function
(for `required`) and writes the arguments, so a call is forced to begin but not guaranteed to
parse; a reply that does not parse stays content, as with `auto`.

The forced text is part of the prompt, not of the completion: the prompt token ids carry it and
the completion ids are only what was sampled, so a learner trains exactly what was sampled,
with the logprobs it was sampled with. Templates without `<tool_call>` syntax are refused.
"""

from __future__ import annotations

import json

from inference.openai.errors import ApiError
from inference.openai.models import ChatCompletionRequest, NamedToolChoice

HERMES_OPENER = "<tool_call>"


def is_forced(req: ChatCompletionRequest) -> bool:
    """Whether the request forces a tool call (`required` or a named function)."""
    return req.tool_choice not in (None, "auto", "none")


def forced_call_text(req: ChatCompletionRequest) -> str:
    """The text a forced tool choice puts before the sampled tokens ('' when none is forced)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return f'{HERMES_OPENER}\n{{"name": {json.dumps(choice.function.name)}, "arguments": '
    if choice == "required":
        return f'{HERMES_OPENER}\n{{"name": "'
    return ""


def check_template(forced: str, chat_template: str | None) -> None:
    """Refuse a forced choice where the model's template does not write Hermes calls."""
    if forced and HERMES_OPENER not in (chat_template or ""):
        raise ApiError(
            "tool_choice 'required' or a named function is enforced by starting the model's "
            f"{HERMES_OPENER} call; this model's chat template has no such syntax",
            "tool_choice",
        )
