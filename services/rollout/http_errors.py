"""The HTTP API's errors and SSE framing (http_api.py): every error leaves as OpenAI's
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from tlt.services.rollout.openai_schema import ErrorBody, ErrorResponse, field_problem
from tlt.services.rollout.replicas import InvalidRequestError, ReplicaUnavailableError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def pool_error(e: InvalidRequestError | ReplicaUnavailableError) -> ApiError:
    """What the pool raised, as the client sees it: 400 (the engine refused it) or 503 (its replica died, or the
    server is shutting down)."""
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e))
    return ApiError(503, str(e), "server_error", code="unavailable")


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a request the schema refused: up to five problems; `param` the first one's field, named
    as OpenAI names it (`messages.[1].role`), pydantic's union branches left out."""
    parts, first = [], None
    for err in e.errors()[:5]:
        message, param = field_problem(err)
        first = first or param or None
        parts.append(message)
    return "invalid request: " + "; ".join(parts), first


def is_unicode(obj: Any) -> bool:
    """No lone UTF-16 surrogate in any string: `json` decodes `"\\ud800"` (and its raw UTF-8 bytes) to one, which
    the tokenizer cannot encode (a TypeError: a 500 instead of the client's 400)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


class Sse:
    @staticmethod
    def data(obj: BaseModel | dict, nulls: tuple[str, ...] = ()) -> bytes:
        """`nulls`: keys sent as null when unset (include_usage: every chunk but the last has `"usage": null`)."""
        # ASCII-escaped: generated text may hold U+2028, U+0085, ... which line splitters
        # (not the SSE spec's, but many clients') take for line breaks inside the event.
        payload = obj.model_dump(exclude_none=True) if isinstance(obj, BaseModel) else obj
        for key in nulls:
            payload.setdefault(key, None)
        return f"data: {json.dumps(payload, ensure_ascii=True, separators=(',', ':'))}\n\n".encode()

    done = b"data: [DONE]\n\n"
