"""A tiny, randomly initialised causal LM and byte-level tokenizer, built locally.

`build_tiny_model(out_dir, seed)` writes a Hugging Face directory (safetensors weights,
config, tokenizer and a ChatML chat template that understands `tools` and
`add_generation_prompt`) that `AutoModelForCausalLM` / `AutoTokenizer` load with no network.
It is what every test, the CPU policy server and the demo run on. Invariants: nothing is
downloaded; the same seed gives the same bytes of weights; the tokenizer's vocabulary is
exactly the model's (`vocab_size == len(tokenizer)`), so no sampled id is undecodable.

CLI: `python -m inference.tiny OUT_DIR [--seed N]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.settings import HelpFormatter

# Ordered: ids 256.. in this order. The first three are true specials (skipped by
# `decode(skip_special_tokens=True)`); the tool tags stay visible text so that tool-call
# parsers see them after decoding, as with Qwen2.5.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Function signatures are within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return a JSON object within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map, the alphabet of ByteLevel."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast (lazy import keeps CLIs fast)
    """A byte-level tokenizer: one token per byte (ids 0..255, id == byte) plus the specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    initializer_range: float = 0.02,
    tokenizer: object | None = None,
) -> Path:
    """Write a randomly initialised Llama-architecture causal LM plus tokenizer to `out_dir`; return it.

    Deterministic by `seed` (the global torch RNG is left untouched). Weights are float32
    safetensors. Takes well under a second once torch and transformers are imported.
    `tokenizer` (a transformers tokenizer with a chat template) replaces the byte-level one:
    a real model's tokenizer and template over the same tiny network (tests/chat_models).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=list(dict.fromkeys([eos, pad])), pad_token_id=pad
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.tiny", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = build_tiny_model(args.out_dir, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
