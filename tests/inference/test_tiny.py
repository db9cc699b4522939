"""The tiny model: built locally, deterministic by seed, loadable with the Auto classes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference.tiny import SPECIAL_TOKENS, TEXT_TOKENS, build_tiny_model
from inference.tiny import main as tiny_main


def test_loads_with_auto_classes_and_vocab_matches(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == len(tok) == 256 + len(SPECIAL_TOKENS) + len(TEXT_TOKENS)
    assert (path / "model.safetensors").is_file()
    ids = tok.encode("hi <|im_end|>")
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id in model.generation_config.eos_token_id


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = load_file(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_byte_level_round_trip_and_special_tokens(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    text = "e\u0301 ünïcödé 😀\n\n\t  spaces<tool_call>{}</tool_call>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # no normalisation: exact bytes back
    assert ids[:3] == list("e\u0301".encode())  # id == byte value
    for special in (*SPECIAL_TOKENS, *TEXT_TOKENS):
        assert len(tok.encode(special)) == 1, special
    # True specials vanish with skip_special_tokens; tool tags stay for tool-call parsers.
    ids = tok.encode("<|im_start|>a<tool_call>b</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call>"


def test_chat_template_tools_and_generation_prompt(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": "2"},
    ]
    text = tok.apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '{"type": "function", "function": {"name": "add"' in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"


def test_cli_builds_a_loadable_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert tiny_main([str(out), "--seed", "5"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    ref = load_file(build_tiny_model(tmp_path / "ref", seed=5) / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(ref[k], got[k]) for k in ref)
