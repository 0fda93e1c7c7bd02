"""Prompt-file rows refused with what is wrong and where: an empty chat prompt, a pretty-printed JSON object.

Real files in a temporary folder, read by the loader the trainer and `tlt data check` use; nothing is faked.
"""

from __future__ import annotations

import json

import pytest

from tlt.services.trainer.data import DataError, load_prompts


def _refusal(path, model_dir=None) -> str:  # noqa: ANN001
    with pytest.raises(DataError) as e:
        load_prompts(path, model_dir=model_dir)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder holding the real task tokenizer (its ChatML chat template inside tokenizer_config.json)."""
    from tlt.model.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "  "}, {"role": "user", "content": "\n"}],
])
def test_a_chat_prompt_with_no_text_is_refused_as_an_empty_text_prompt_is(tmp_path, model_dir, messages):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "", "answer": "2"}) + "\n")
    assert "'prompt' must be a non-empty" in _refusal(f, model_dir)  # the text prompt's refusal, for comparison
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n"
                 + json.dumps({"prompt": messages, "answer": "1"}) + "\n")
    msg = _refusal(f, model_dir)
    assert msg.startswith(f"{f}:2: ") and "'prompt'" in msg and "empty" in msg, msg


def test_a_chat_prompt_with_some_text_is_kept(tmp_path, model_dir):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "2+2="}],
                             "answer": "4"}) + "\n")
    (item,) = load_prompts(f, model_dir=model_dir)
    assert "2+2=" in item.prompt


def test_a_pretty_printed_json_object_says_what_a_file_must_hold(tmp_path):
    f = tmp_path / "pretty.json"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}, indent=1) + "\n")
    msg = _refusal(f)
    assert "JSON array of rows" in msg and "one object per line" in msg, msg
    assert str(f) in msg


def test_a_first_line_that_is_not_json_names_the_expected_forms(tmp_path):
    f = tmp_path / "broken.jsonl"
    f.write_text('{"prompt": "1+1=",\n')
    msg = _refusal(f)
    assert msg.startswith(f"{f}:1: not valid JSON") and "JSON array of rows" in msg, msg


def test_a_bad_later_line_of_jsonl_is_a_plain_json_error(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    msg = _refusal(f)
    assert msg.startswith(f"{f}:2: not valid JSON") and "array" not in msg, msg
