"""OpenAI-compatible request and response models (the /v1 JSON wire format).

Requests are parsed strictly (unknown fields, wrong types and out-of-range
values are rejected with a message naming the field; `null` takes the field's
default, as in the OpenAI API) and converted to the engine's `SamplingParams`.
TLT extensions beside the OpenAI fields: `top_k`,
`min_p`, `ignore_eos`, `stop_token_ids`, `reproducible`; vLLM's `repetition_penalty`, `min_tokens`,
`skip_special_tokens`, `spaces_between_special_tokens` and `include_stop_str_in_output` are taken at their
vLLM defaults, which are this server's behaviour, and refused otherwise; every response carries the weight
versions that produced it in `tlt_versions`. OpenAI fields the engine cannot
honour (penalties, logit_bias, echo, suffix, a `tool_choice` that forces a
call, the deprecated `functions` / `function_call`) are refused with a 400
naming the field in `param` (`messages.[i].audio` for a message's), rather
than silently ignored. A `tool_choice` without `tools` is a 400 as in the
OpenAI API, in its words (vLLM lets "none" through). A `tool` message in the
history (a tool's result) is text for the chat template like any other role;
as in the OpenAI API it must carry the `tool_call_id` of the call it answers,
and no other role may (a 400 naming `messages.[i].tool_call_id` either way).
A message's text parts are joined with "\n", as vLLM joins them for a template
that reads `content` as a string; `content: null` is for an assistant message
only (a 400 naming `messages.[i].content` on another role, as the OpenAI API
and vLLM refuse it).

Tools: `tools` are checked here (a 400 naming e.g. `tools.[2].function.name`)
and handed as sent to the chat template; an assistant message's `tool_calls`
(the OpenAI form: `arguments` a JSON string) reach the template in the form HF
templates read (`arguments` the decoded mapping). The calls a completion makes
are parsed from its text (tool_calls.py) into `ChatMessageOut.tool_calls`.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tlt.services.rollout.types import SamplingParams


VLLM_DEFAULTS: dict[str, Any] = {"repetition_penalty": 1.0, "min_tokens": 0, "skip_special_tokens": True,
                                  "spaces_between_special_tokens": True, "include_stop_str_in_output": False}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # TLT extensions
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    reproducible: bool = False  # the tokens plain decoding gives `seed`, whatever speculation does (SamplingParams)
    # vLLM's extensions, taken at the values that are this server's behaviour (clients written for vLLM send them)
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`null`, the OpenAI API's "not set" (it marks these fields nullable), takes the field's default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields

        def defaulted(k: str) -> bool:
            f = fields.get(k)
            return f is not None and not f.is_required() and type(None) not in get_args(f.annotation)

        return {k: v for k, v in data.items() if v is not None or not defaulted(k)}

    def invalid(self) -> tuple[str, str] | None:
        """(message, param) of a 400 that names one field of this request: a field the OpenAI API requires that is
        missing (in its wording), or one given where it does not belong; None when nothing is."""
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(message, param) of the 400 for a field this server does not honour, named as `invalid()` names one."""
        if self.presence_penalty or self.frequency_penalty:
            return ("presence_penalty and frequency_penalty are not supported (they would change the policy's "
                    "distribution)", "presence_penalty" if self.presence_penalty else "frequency_penalty")
        if self.logit_bias:
            return "logit_bias is not supported (it would change the policy's distribution)", "logit_bias"
        for name, default in VLLM_DEFAULTS.items():
            if getattr(self, name) != default:
                return (f"{name} is supported only at {json.dumps(default)}, vLLM's default (this server's "
                        f"behaviour); got {json.dumps(getattr(self, name))}", name)
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            reproducible=self.reproducible,
        )
        params.validate()
        return params


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo is not supported", "echo"
        if self.suffix:
            return "suffix is not supported", "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of other than n is not supported", "best_of"
        return super().unsupported()


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


def api_path(loc: Any) -> list[str]:
    """A pydantic error location as OpenAI names a field (`messages.[1].content`): list indices in brackets, and
    the names pydantic gives a union's branches (`str`, `list[ContentPart]`, `function-after[...]`) left out."""
    out = []
    for x in loc:
        if isinstance(x, int):
            out.append(f"[{x}]")
        elif not (str(x) in {"str", "int", "float", "bool", "dict", "list", "none"} or "[" in str(x) or "-" in str(x)):
            out.append(str(x))
    return out


def field_problem(err: Any, prefix: str = "") -> tuple[str, str]:
    """(message, param) of one pydantic error, its location under `prefix`, in the API's words: an unknown
    parameter, a missing required one, else the field's error and the value given."""
    param = ".".join([*([prefix] if prefix else []), *api_path(err["loc"])])
    if err["type"] == "extra_forbidden":
        return f"unknown parameter {param!r}", param
    if err["type"] == "missing":
        return f"missing required parameter {param!r}", param
    return f"{param}: {err['msg']} (got {err.get('input')!r})"[:300], param


def content_part_problem(i: int, j: int, raw: Any) -> tuple[str, str] | None:
    """(message, param) of the 400 for part `j` of message `i`'s content, naming the field as the OpenAI API does
    (`messages.[0].content.[1].type`); None when it is a text part. Only text is served: an `image_url` part (what
    the SDK sends for vision), `input_audio`, `file` or `refusal` is refused by its type, in one line, rather
    than with the pydantic errors of every member of a union."""
    param = f"messages.[{i}].content.[{j}]"
    if not isinstance(raw, dict):
        return f"{param} must be a content part (a JSON object), got {raw!r}"[:300], param
    kind = raw.get("type")
    if kind != "text":
        return (f"messages[{i}].content[{j}]: only text content parts (type 'text') are supported; got type "
                f"{kind!r}"[:300], f"{param}.type")
    try:
        ContentPart.model_validate(raw)
    except ValidationError as e:
        return field_problem(e.errors()[0], param)
    return None


TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # the OpenAI API's rule for a function's name


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema object
    strict: bool | None = None  # OpenAI's strict schema adherence: accepted, not enforced (no constrained decoding)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.fullmatch(v):
            raise ValueError(f"a function name must match {TOOL_NAME.pattern} (got {v!r})")
        return v


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


def tool_problem(i: int, raw: Any) -> tuple[str, str] | None:
    """(message, param) of the 400 for `tools[i]`, naming the field as the OpenAI API does
    (`tools.[2].function.name`); None when it is a valid function tool."""
    try:
        Tool.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join([f"tools.[{i}]", *(str(x) for x in err["loc"])])
        if err["type"] in ("extra_forbidden", "missing"):
            return field_problem(err, f"tools.[{i}]")
        if err["type"] in ("literal_error", "dict_type", "model_type"):
            want = {"literal_error": "'function' (the only tool type served)", "dict_type": "a JSON object",
                    "model_type": "a JSON object"}[err["type"]]
            return f"{param} must be {want}, got {err.get('input')!r}"[:300], param
        return f"{param}: {err['msg'].removeprefix('Value error, ')}"[:300], param
    return None


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON of an object, as the OpenAI API carries it
    parsed_arguments: Any | None = None  # the SDK's own parse of `arguments` in a streamed message: ignored


class ToolCallIn(_Strict):
    """A call in an assistant message of the history (the SDK replays its response message with them; a message
    its stream helper put together also holds each call's `index` and the SDK's `parsed_arguments`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = None  # its place in a streamed message: ignored

    def for_template(self) -> dict[str, Any]:
        """HF chat templates (Qwen's, Hermes') read `arguments` as a mapping (`tojson` of it, or its items);
        `invalid()` has checked that the JSON string holds an object."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # RecursionError: `[[[[...` nested past the interpreter's stack
        return False


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Any] | None = None  # a list: content parts, checked by `invalid()` (text ones only)
    name: str | None = None
    tool_call_id: str | None = None  # on a `tool` message: the call it answers (the SDK sends it on replay)
    tool_calls: list[ToolCallIn] | None = None  # on an assistant message: the calls it made
    # The other fields of an OpenAI assistant message: the SDK's response message carries them (null), so a
    # reply replayed into the next turn's history (`messages.append(r.choices[0].message.model_dump())`) holds
    # them. Null is accepted; a value is refused (`unsupported()`, `invalid()`): this server makes no audio or
    # refusals, and the deprecated `function_call` is not served.
    refusal: str | None = None
    function_call: Any | None = None
    audio: Any | None = None
    annotations: list[Any] | None = None
    parsed: Any | None = None  # the SDK's client-side parse of the content (its stream helper adds it): ignored

    def invalid(self, i: int) -> tuple[str, str] | None:
        """(message, param) of a 400 for this message, the `i`th of the history. `content: null` is only for an
        assistant message (the OpenAI API requires content on the others; vLLM's request model refuses it there)."""
        if self.content is None and self.role != "assistant" and "content" in self.model_fields_set:
            return (f"messages[{i}]: content must be a string or a list of text parts for role {self.role!r}, got "
                    "null (only an assistant message may have null content)", f"messages.[{i}].content")
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if (problem := content_part_problem(i, j, part)) is not None:
                return problem
        if self.function_call is not None:
            return (f"messages[{i}]: function_call (the deprecated functions API) is not supported; use tool_calls",
                    f"messages.[{i}].function_call")
        if self.tool_calls and self.role != "assistant":
            return f"messages[{i}]: tool_calls are only for role 'assistant'", f"messages.[{i}].tool_calls"
        for j, call in enumerate(self.tool_calls or ()):
            if not _json_object(call.function.arguments):
                param = f"messages.[{i}].tool_calls.[{j}].function.arguments"
                return (f"{param} must be a JSON object in a string (got {call.function.arguments!r})"[:300], param)
        return None

    def unsupported(self, i: int) -> tuple[str, str] | None:
        """(message, param) of a 400 for a field of this message, the `i`th, that is not served."""
        if self.audio is not None:
            return f"messages[{i}]: audio is not supported", f"messages.[{i}].audio"
        if self.refusal is not None or self.annotations:
            field = "refusal" if self.refusal is not None else "annotations"
            return (f"messages[{i}]: assistant messages with a refusal or annotations are not supported",
                    f"messages.[{i}].{field}")
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # text parts only (`invalid()`), one a line, as vLLM joins them for a template that reads `content` as a
        # string (vllm/entrypoints/chat_utils.py, _parse_chat_message_content_parts)
        return "\n".join(p["text"] for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: role and text, plus `name`, `tool_call_id` and `tool_calls`
        when given (as vLLM passes them: a template may render them; the tiny task template ignores them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        return out


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """tool_choice: "auto" (the default with tools): the model's text is parsed for calls; "none": the tools are
    still rendered into the prompt (as vLLM does unless started with --exclude-tools-when-tool-choice-none: the
    prompt is the same whatever the choice) and the text is not parsed; either without `tools` is refused, as the
    OpenAI API refuses it. "required" and a named function are refused: forcing a call
    needs constrained decoding, which this server does not do. parallel_tool_calls=false keeps only the first
    call of a completion (the model may still write more; they are dropped)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # checked by `invalid()`, which names the field (`tools.[2].function.name`)
    tool_choice: Any | None = None
    parallel_tool_calls: bool = True
    functions: Any | None = None  # the deprecated functions API: refused by `invalid()`
    function_call: Any | None = None

    def invalid(self) -> tuple[str, str] | None:
        """A `tool` message without `tool_call_id`, or another role with one: the 400 names the message's field
        (`messages.[i].tool_call_id`), so a client can tell which message of a long history is wrong. Likewise a
        malformed tool (`tools.[i]...`), a tool call's `arguments` that hold no JSON object, a content part that is
        not text (`messages.[i].content.[j].type`), `top_logprobs` without `logprobs: true`, a `tool_choice`
        without `tools` (as the OpenAI API refuses it), or one that cannot be honoured."""
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:  # the OpenAI API's message and param for it
                return ("Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'.",
                        f"messages.[{i}].tool_call_id")
            if m.role != "tool" and m.tool_call_id is not None:
                return f"messages[{i}]: tool_call_id is only for role 'tool'", f"messages.[{i}].tool_call_id"
            if (problem := m.invalid(i)) is not None:
                return problem
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs: true", "top_logprobs"
        for field in ("functions", "function_call"):
            if getattr(self, field) is not None:
                return (f"{field} (the deprecated functions API) is not supported; use tools and tool_choice",
                        field)
        for i, tool in enumerate(self.tools or ()):
            if (problem := tool_problem(i, tool)) is not None:
                return problem
        choice = self.tool_choice
        if choice is not None and not self.tools:  # the OpenAI API's message and param, "none" too
            return ("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
                    "tool_choice")
        if choice == "required" or isinstance(choice, dict):
            return (f"tool_choice {choice!r} is not supported: forcing a tool call needs constrained decoding, "
                    "which this server does not do; use 'auto' (the model decides) or 'none'", "tool_choice")
        if choice not in (None, "none", "auto"):
            return f"tool_choice must be 'none' or 'auto' (got {choice!r})", "tool_choice"
        return super().invalid()

    def parses_tools(self) -> bool:
        """Whether the completions' text is parsed for tool calls: tools given and tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or ())

    def unsupported(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            if (why := m.unsupported(i)) is not None:
                return why
        return super().unsupported()


# ---- responses ------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tlt"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TltVersions(BaseModel):
    """The weight versions that produced the tokens: `policy` the newest; `policy_min` the oldest,
    present only when a weight swap landed while the sequence(s) were generating."""

    policy: int
    drafter: int
    policy_min: int | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class _KeepsNulls(BaseModel):
    """A response object whose `nullable` keys the OpenAI API always sends, null or not. Responses are dumped
    without their None fields (the optional extensions), and these went with them: a client that reads
    `chunk["choices"][0]["finish_reason"]`, as the API reference shows, got a KeyError on every chunk but
    the last."""

    keep_null: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _with_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in self.keep_null:
            out.setdefault(key, None)
        return out


class CompletionChoice(_KeepsNulls):
    keep_null = ("logprobs", "finish_reason")
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    tlt_versions: TltVersions | None = None


class CompletionResponse(BaseModel):
    """Also used for streamed chunks (same object name in the OpenAI API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    tlt_versions: TltVersions | None = None


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # compact JSON of an object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(_KeepsNulls):
    keep_null = ("content",)  # null when the message is all tool calls, as the OpenAI API sends it
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ToolCallDelta(ToolCall):
    """A streamed call: sent whole, in one chunk of its own, `index` its place in the message's `tool_calls`."""

    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChoice(_KeepsNulls):
    keep_null = ("logprobs", "finish_reason")
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    tlt_versions: TltVersions | None = None


class ChatChunkChoice(_KeepsNulls):
    keep_null = ("logprobs", "finish_reason")
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    tlt_versions: TltVersions | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    tlt_versions: TltVersions | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    tlt_versions: TltVersions | None = None


class ErrorBody(_KeepsNulls):
    keep_null = ("param", "code")
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
