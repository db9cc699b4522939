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
- `sse`: the server-sent-events encoding.

Invariant: nothing under `inference.openai` imports torch or `inference.engine`.
"""
