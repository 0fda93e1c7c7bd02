"""The OpenAI request and response models (services/rollout/openai_schema.py) on their own: what a field's absence,
`null` or an odd value turns into, which fields are refused and how the 400 names them, and which null keys a
response keeps. Real pydantic models, no server (tests/test_rollout_invalid.py has the same refusals over HTTP)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tlt.services.rollout.openai_schema import (
    ChatCompletionRequest,
    ChatMessageOut,
    CompletionRequest,
    ErrorBody,
    FunctionCall,
    ToolCall,
    api_path,
    field_problem,
    tool_problem,
)


def completion(**kw) -> CompletionRequest:  # noqa: ANN003
    return CompletionRequest.model_validate({"model": "m", "prompt": "1+2=", **kw})


def chat(messages: list[dict], **kw) -> ChatCompletionRequest:  # noqa: ANN003
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **kw})


def test_completion_max_tokens_is_16_when_absent_and_unlimited_when_null() -> None:
    """The completions API's default is 16 tokens; an explicit null is no limit (as vLLM reads it: the context
    bounds it). Taking null as the default cut a client's null to 16 tokens; a default of None ran to the context."""
    assert completion().max_tokens == 16
    assert completion(max_tokens=None).max_tokens is None
    assert completion(temperature=None).temperature == 1.0  # null on a non-nullable field: its default


def test_a_single_stop_string_is_one_stop_sequence() -> None:
    """`stop: "</a>"` stops at "</a>"; read as a sequence it became four one-character stops ("<", "/", "a", ">")."""
    assert completion(stop="</a>").sampling_params(16, None).stop == ("</a>",)
    assert completion(stop=["x", "yz"]).sampling_params(16, None).stop == ("x", "yz")


@pytest.mark.parametrize(("kw", "param"), [({"frequency_penalty": 0.5}, "frequency_penalty"),
                                           ({"presence_penalty": 0.5}, "presence_penalty"),
                                           ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 3, "n": 2}, "best_of"),
                                           ({"suffix": "end"}, "suffix")])
def test_unserved_fields_are_refused_by_name(kw: dict, param: str) -> None:
    """A frequency penalty alone, a best_of below n as above it, and a suffix change what is sampled or returned:
    each is refused naming its own field, not served silently as if absent."""
    problem = completion(**kw).unsupported()
    assert problem is not None and problem[1] == param, problem
    assert completion(best_of=2, n=2).unsupported() is None  # best_of equal to n is what is served


def test_a_union_field_error_names_the_field_as_the_api_does() -> None:
    """pydantic locates an error in a union under each branch's name (`list[any]`, `function-after[...]`); the 400's
    `param` is the API's `messages.[0].content`, without them."""
    assert api_path(("messages", 0, "content", "list[any]")) == ["messages", "[0]", "content"]
    assert api_path(("tools", 2, "function-after[_name(), str]")) == ["tools", "[2]"]
    with pytest.raises(ValidationError) as e:
        chat([{"role": "user", "content": 7}])
    assert {field_problem(err)[1] for err in e.value.errors()} == {"messages.[0].content"}


@pytest.mark.parametrize("name", ["get weather", "get_weather ", "f\n", "f!"])
def test_a_tool_name_is_the_whole_name(name: str) -> None:
    """OpenAI's rule is the whole name in [a-zA-Z0-9_-]{1,64}: a trailing space or newline, or a character past a
    valid start, is refused (matched from the start only, or stripped, they were taken)."""
    problem = tool_problem(0, {"type": "function", "function": {"name": name}})
    assert problem is not None and problem[1] == "tools.[0].function.name", problem


def test_an_empty_history_is_refused_by_the_model() -> None:
    """`messages: []` is a 400 naming messages before any template is rendered."""
    with pytest.raises(ValidationError) as e:
        chat([])
    assert field_problem(e.value.errors()[0])[1] == "messages"


def test_a_replayed_message_with_annotations_is_refused_and_a_name_reaches_the_template() -> None:
    """Annotations (web-search citations) on a replayed assistant message are not served: a 400 naming them, not
    dropped. A message's `name` is passed to the chat template, as vLLM passes it."""
    req = chat([{"role": "user", "content": "hi", "name": "ann"},
                {"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}])
    assert req.unsupported() == ("messages[1]: assistant messages with a refusal or annotations are not supported",
                                 "messages.[1].annotations")
    assert req.messages[0].for_template() == {"role": "user", "content": "hi", "name": "ann"}


def test_responses_keep_the_null_keys_the_api_always_sends() -> None:
    """Responses are dumped without None fields; a message that is all tool calls still sends `content: null`, and an
    error its `code: null` (clients index them: a KeyError otherwise)."""
    call = ToolCall(id="c1", function=FunctionCall(name="f", arguments="{}"))
    assert ChatMessageOut(content=None, tool_calls=[call]).model_dump(exclude_none=True)["content"] is None
    assert ErrorBody(message="m", type="invalid_request_error").model_dump(exclude_none=True) == {
        "message": "m", "type": "invalid_request_error", "param": None, "code": None}
