"""OpenAI-compatible protocol pieces that do not depend on the CPU engine or on torch.

What lives here is shared by every OpenAI-compatible endpoint of the project: the CPU policy
server's routes (`inference/openai_routes.py`) and the worker's token-capturing endpoint.

- `errors`: `ApiError` and the error body in vLLM 0.33's `ErrorResponse` shape;
- `models`: pydantic request models of `/v1/chat/completions`, `/tokenize`, `/detokenize`;
- `render`: the `ChatRenderer` protocol (messages + tools -> prompt token ids) and its
  Hugging Face tokenizer implementation;
- `text`: incremental detokenization with stop strings and stream hold-back;
- `tools`: the model's text -> OpenAI `tool_calls`, through `envs.parsing`;
- `responses`: chat responses, stream chunks and logprobs as JSON-ready dicts;
- `responses_api`, `responses_route`: `/v1/responses` (the Responses API) as a translation over
  an endpoint's chat path, with stored responses for `previous_response_id`;
- `tool_choice`: a forced `tool_choice`, enforced by the call opener put at the end of the prompt;
- `sse`: the server-sent-events encoding.

Invariant: nothing under `inference.openai` imports torch or `inference.engine`.
"""
