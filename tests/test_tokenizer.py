"""The task tokenizer: exact round trip on task text, digits one per token, special ids, ChatML template, determinism."""

from __future__ import annotations

from transformers import AutoTokenizer

from tlt.model.tokenizer import CHAT_TEMPLATE, build_tokenizer, test_tokenizer
from tlt.task import format_prompt, generate_problems


def test_round_trip_task_text():
    tok = test_tokenizer()
    for p in generate_problems(200, seed=11):
        text = format_prompt(p) + p.solution + "<|im_end|>"
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    odd = "  mixed Text, ünïcödé + 123 ==\t\n"
    assert tok.decode(tok(odd)["input_ids"]) == odd  # byte-level: anything round-trips


def test_digits_and_lines_are_compact():
    tok = test_tokenizer()
    ids = tok("2+7=9\n")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["2", "+", "7", "=", "9", "Ċ"]
    assert len(tok("123")["input_ids"]) == 3  # digits never merge
    assert len(tok) < 320


def test_special_tokens():
    tok = test_tokenizer()
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.bos_token is None and tok.bos_token_id is None  # as Qwen's: no bos token
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(special)["input_ids"]) == 1
    assert tok.decode(tok("<|im_start|>user\nhi<|im_end|>")["input_ids"], skip_special_tokens=True) == "user\nhi"


def test_chat_template_matches_format_prompt():
    tok = test_tokenizer()
    p = generate_problems(1, seed=0)[0]
    msgs = [{"role": "user", "content": p.prompt}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == format_prompt(p)
    both = msgs + [{"role": "assistant", "content": p.solution}]
    assert tok.apply_chat_template(both, tokenize=False) == format_prompt(p) + p.solution + "<|im_end|>\n"


def test_saved_folder_loads_with_template(tmp_path):
    build_tokenizer(tmp_path, seed=0)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert '"chat_template"' in (tmp_path / "tokenizer_config.json").read_text()
    assert loaded.padding_side == "left" and loaded.bos_token is None
    text = format_prompt(generate_problems(1, seed=3)[0])
    assert loaded(text)["input_ids"] == test_tokenizer()(text)["input_ids"]


def test_deterministic_by_seed(tmp_path):
    build_tokenizer(tmp_path / "a", seed=7)
    build_tokenizer(tmp_path / "b", seed=7)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
