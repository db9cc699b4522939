"""Everything that speaks to inference servers, and the CPU policy server itself.

The generation client (token ids in; token ids, logprobs and weight versions out,
over many servers), the weight-sync client (file and NCCL transfer through vLLM's RL
routes), the `/v1/completions` protocol shapes, and the CPU policy server
(`python -m inference`) that stands in for vLLM where there is no GPU.
"""
