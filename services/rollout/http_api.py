"""The OpenAI-compatible HTTP API (FastAPI, served by uvicorn).

    POST /v1/completions, /v1/chat/completions   (JSON or SSE stream)
    GET  /v1/models, /v1/models/{id}, /health, /metrics   (HEAD too: the same status and headers, no body)

    body -> size check (413) -> JSON (400) -> strict pydantic model (400) -> model id (404)
         -> tokenize (chat template for chat, tools included) -> length checks (400) -> GenerationRequest
         per prompt (seeded: prompt i's seed is engine/sequence.py prompt_seed(seed, i)) -> ReplicaPool.generate
         -> OpenAI choices (+ tlt_versions; a chat with tools: calls parsed from each choice's text,
         tool_calls.py) or SSE `data: {...}` ... `data: [DONE]`

Every error leaves as `{"error": {"message", "type", "param", "code"}}`: 400
for anything wrong with the request (FastAPI's 422 never reaches a client),
404 for an unknown model or route, 413 for a body over `max_request_bytes`,
503 when no engine replica is alive and none is restarting (a request waits
for one that is), 401 on /v1/* without the API key when one is set
(TLT_API_KEY or [rollout] api_key). Prompts are tokenised and non-streamed
responses built on a thread, off the loop every stream and gRPC call share
(front_prompts.py). A client that disconnects
aborts its request, streaming or not (a non-streaming one counts as 499,
client_closed). Every error counts in rollout_rejected_total{reason}. The handler is the deliberate boundary:
request errors are answered and the server goes on; errors inside a started
stream are sent as a final `data: {"error": ...}` chunk before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tlt.services.common.auth import token_matches
from tlt.services.common.gc_heap import GcPauses
from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.rollout import openai_convert as conv
from tlt.services.rollout.config import RolloutConfig
from tlt.services.rollout.engine.sequence import prompt_params
from tlt.services.rollout.openai_schema import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)
from tlt.services.rollout.errors import OverloadedError
from tlt.services.rollout.http_errors import ApiError, Sse, is_unicode, pool_error, validation_message
from tlt.services.rollout.front_prompts import (
    PromptEncoder,
    PromptTooLong,
    RequestThreads,
    bad_stop_ids,
    kv_problem,
)
from tlt.services.rollout.replicas import InvalidRequestError, ReplicaPool, ReplicaUnavailableError
from tlt.services.rollout.pool_metrics import PoolMetrics
from tlt.services.rollout.types import CompletionOutput, GenerationRequest, SamplingParams, StepOutput

log = get_logger(__name__)
COUNTED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # http_requests_total{endpoint}


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body however the response ends. A client gone while a chunk was being
    written cancels the send, and the body generator, suspended at its `yield`, stayed open until garbage collected:
    its finally (the requests' abort, their admission places) did not run (a chat stream left during its role chunks
    held its n places for 60 s)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            import anyio

            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


class OpenAIServer:
    """The handlers; the FastAPI app is `OpenAIServer(...).app`."""

    def __init__(self, pool: ReplicaPool, tokenizer: Any, model_name: str, config: RolloutConfig, api_key: str,
                 metrics: Metrics, gc_pauses: GcPauses | None = None, work: RequestThreads | None = None) -> None:
        self.pool, self.tokenizer, self.model_name, self.config, self.metrics = (
            pool, tokenizer, model_name, config, metrics)
        self.gc_pauses = gc_pauses  # the front process's collections (RolloutServer installs it)
        self.prompts = PromptEncoder(tokenizer)  # text -> ids, bounded by the context (front_prompts.py)
        self.work = work or RequestThreads()  # prompts tokenised and responses built there, off the loop
        self.created = int(time.time())
        self.m_requests = metrics.counter("http_requests_total", "HTTP API requests by endpoint and status",
                                          ("endpoint", "status"))
        self.m_latency = metrics.histogram("http_request_seconds", "HTTP request time to the last byte",
                                           ("endpoint",))
        self.m_rejected = metrics.counter("rejected_total", "requests and weight pushes refused, by reason",
                                          ("reason",))
        self.m_pool = PoolMetrics(metrics)
        self.api_key = api_key  # auth.resolve_api_key's: '' when no key is required
        self.app = self._build()

    # ---- app -------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="TLT rollout", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def _api_error(_: Request, e: ApiError) -> JSONResponse:
            self.m_rejected.labels(e.code or f"http_{e.status}").inc()
            return e.response()

        @app.middleware("http")
        async def _api_key(request: Request, call_next: Any) -> Any:
            if self.api_key and request.url.path.startswith("/v1/"):
                given = request.headers.getlist("authorization")  # two are ambiguous (RFC 9110 allows one)
                if len(given) != 1 or not token_matches(given[0], self.api_key):
                    self.m_rejected.labels("unauthenticated").inc()
                    endpoint = COUNTED_PATHS.get(request.url.path.rstrip("/"))
                    if endpoint is not None:  # in http_requests_total as every other answer of the endpoint
                        self._count(endpoint, 401, time.perf_counter())
                    return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                    "authentication_error", code="invalid_api_key").response()
            return await call_next(request)

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, e: Exception) -> JSONResponse:
            # the boundary for what no handler foresaw (a checkpoint's broken chat template, a bug): the client
            # still gets the error shape, the log the traceback (uvicorn prints it as the exception goes on up)
            self.m_rejected.labels("internal_error").inc()
            return ApiError(500, f"internal error while serving {request.url.path}: {type(e).__name__}: {e}"[:500],
                            "server_error", code="internal_error").response()

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
            kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
            return ApiError(e.status_code, str(e.detail), kind).response()

        # HEAD as GET without the body (load balancers' and probes' health checks): FastAPI's routes, unlike
        # Starlette's own, do not add HEAD to a GET route; uvicorn sends a HEAD response's headers only
        get = ["GET", "HEAD"]
        app.add_api_route("/health", self.health, methods=get)
        app.add_api_route("/metrics", self.metrics_endpoint, methods=get)
        app.add_api_route("/v1/models", self.models, methods=get)
        app.add_api_route("/v1/models/{model:path}", self.model, methods=get)  # ids may hold slashes
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return app

    async def health(self) -> JSONResponse:
        """200 while any replica serves ("degraded" when some are dead or restarting: a health check must not
        restart the whole server for one replica the pool restarts itself), 503 when none does."""
        alive, total = sum(r.alive for r in self.pool.replicas), len(self.pool.replicas)
        state = "ok" if alive == total else "degraded" if alive else "no live replica"
        return JSONResponse({"status": state, "replicas_alive": alive, "replicas": total},
                            status_code=200 if alive else 503)

    async def metrics_endpoint(self) -> Response:
        self.m_pool.scrape(self.pool, await self.pool.snapshot(timeout_s=2.0), self.gc_pauses)
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def models(self) -> ModelList:
        return ModelList(data=[self._card()])

    async def model(self, model: str) -> ModelCard:
        """GET /v1/models/{model} (the OpenAI SDK's `models.retrieve`): this server's card, else 404."""
        if model != self.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", param="model", code="model_not_found")
        return self._card()

    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.pool.info.max_model_len)

    # ---- request parsing ---------------------------------------------------------------------

    async def _parse(self, request: Request, cls: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length")
        limit = self.config.max_request_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body of {declared} bytes is over the limit of {limit}", code="too_large")
        body = bytearray()
        try:
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise ApiError(413, f"request body is over the limit of {limit} bytes", code="too_large")
        except ClientDisconnect:  # gone while sending its body: as gone while waiting for its answer
            raise ApiError(499, "the client closed the connection before its request body was in",
                           code="client_closed") from None
        try:
            obj = json.loads(body)
            unicode = is_unicode(obj)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and an integer of over 4,300 digits (a 500)
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:  # json recurses per nesting level: 1 MB of `[[[[` is far past the limit
            raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
        if not unicode:
            raise ApiError(400, "request body holds a string that is not valid Unicode (a lone surrogate such as "
                                "\\ud800)", code="invalid_json")
        try:
            req = cls.model_validate(obj)
        except ValidationError as e:
            message, param = validation_message(e)
            raise ApiError(400, message, param=param) from None
        if req.model != self.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")
        if (missing := req.invalid()) is not None:
            raise ApiError(400, missing[0], param=missing[1])
        if (why := req.unsupported()) is not None:
            raise ApiError(400, why[0], param=why[1])
        if req.stream_options is not None and not req.stream:  # the OpenAI API's own check and wording
            raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options")
        if req.n > self.config.max_n:
            raise ApiError(400, f"n={req.n} is over the limit of {self.config.max_n}", param="n")
        return req

    def _params(self, req: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:  # SamplingParams.validate: "<field> must ...", in the engine's names
            message, field = str(e), str(e).split(" ", 1)[0]
            if field == "logprobs" and isinstance(req, ChatCompletionRequest):  # the chat API's name for it
                message, field = "top_" + message, "top_logprobs"
            if field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:  # the name it came as
                message, field = message.replace("max_tokens", "max_completion_tokens", 1), "max_completion_tokens"
            raise ApiError(400, message, param=field if field in type(req).model_fields else None) from None

    def _check_prompt(self, ids: list[int], params: SamplingParams, where: str, max_tokens_name: str = "max_tokens",
                      prompt_name: str = "prompt") -> None:
        """`prompt_name`: the request field the prompt came from, which a refusal's `param` names (chat: messages)."""
        limit = self.pool.info.max_model_len
        vocab = self.pool.info.vocab_size
        if not ids:
            raise ApiError(400, f"{where} is empty", param=prompt_name)
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{where} has token ids outside the vocabulary [0, {vocab})", param=prompt_name)
        if len(ids) >= limit:
            raise ApiError(400, f"{where} has {len(ids)} tokens; the context length is {limit} "
                                "(prompt + max_tokens must fit)", param=prompt_name, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ApiError(400, f"{max_tokens_name}={params.max_tokens} plus {where} ({len(ids)} tokens) is over the "
                                f"context length {limit}; lower {max_tokens_name} to at most {limit - len(ids)}",
                           param=max_tokens_name, code="context_length_exceeded")
        if (problem := kv_problem(len(ids), params.max_tokens, limit, self.pool.info.kv_capacity_tokens, where,
                                  max_tokens_name)):  # here, not in the replica: a stream has not started yet
            raise ApiError(400, problem, param=max_tokens_name, code="kv_cache_exceeded")

    def _check_stop_ids(self, params: SamplingParams) -> None:
        problem = bad_stop_ids(params.stop_token_ids, self.pool.info.vocab_size)  # once a request
        if problem:
            raise ApiError(400, problem, param="stop_token_ids")

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Text prompts' token ids (blocking: on a thread); a text that cannot fit the context is a 400 without
        being tokenised whole (front_prompts.py)."""
        out = []
        for i, text in enumerate(texts):
            try:
                out.append(self.prompts.encode(text, self.pool.info.max_model_len))
            except PromptTooLong as e:
                where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
                raise ApiError(400, f"{where} {e}", param="prompt", code="context_length_exceeded") from None
        return out

    def _requests(self, prompts: list[list[int]], params: SamplingParams, n: int, prefix: str
                  ) -> list[GenerationRequest]:
        """The engine requests of one API request, once the server has room for them (`ReplicaPool.admit`): 400 for
        one larger than `max_pending_sequences`, 429 with Retry-After (which the OpenAI SDKs honour) when busy."""
        rid = f"{prefix}-{uuid.uuid4().hex}"
        # each prompt its own seed (prompt 0: the request's), not the request's for every prompt: their samples
        # would be alike
        reqs = [GenerationRequest(f"{rid}-{i}", tuple(p), prompt_params(params, i), n) for i, p in enumerate(prompts)]
        try:  # reserved until each reaches the pool: a streamed response submits once its body starts
            self.pool.admit(len(prompts) * n, reserve={r.request_id: n for r in reqs})
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param="n", code="too_many_sequences") from None
        except OverloadedError as e:
            raise ApiError(429, str(e), "rate_limit_error", code="overloaded", headers={"Retry-After": "1"}) from None
        return reqs

    # ---- generation ----------------------------------------------------------------------------

    @staticmethod
    async def _client_gone(request: Request) -> None:
        """Return when the client closes the connection (the body is read: all `receive` gives now is that)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _collect(self, reqs: list[GenerationRequest], request: Request) -> list[list[CompletionOutput]]:
        """Every request's completions; a client that goes away meanwhile aborts them (nothing decodes for nobody)."""
        async def one(r: GenerationRequest) -> list[CompletionOutput]:
            outs = [c async for c in self.pool.generate(r) if isinstance(c, CompletionOutput)]
            return sorted(outs, key=lambda c: c.sample_index)

        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        gathered = asyncio.gather(*tasks)
        gone = asyncio.ensure_future(self._client_gone(request))
        try:
            await asyncio.wait([gathered, gone], return_when=asyncio.FIRST_COMPLETED)
            if not gathered.done() and gone.exception() is None:
                raise ApiError(499, "the client closed the connection; its request was aborted", code="client_closed")
            return list(await gathered)
        except (InvalidRequestError, ReplicaUnavailableError) as e:
            raise pool_error(e) from None
        finally:
            gone.cancel()
            for t in tasks:  # closing generate() aborts what is still running
                t.cancel()
            for r in reqs:  # one cancelled before it reached the pool holds its admission place no longer
                self.pool.take_reservation(r.request_id)
            # a cancelled task ends the gather with CancelledError that nobody awaits: asyncio would log it
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _merged(self, reqs: list[GenerationRequest]) -> AsyncIterator[tuple[int, StepOutput | CompletionOutput]]:
        """Every request's events, tagged with the prompt index, in arrival order."""
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, r: GenerationRequest) -> None:
            try:
                async for ev in self.pool.generate(r, want_steps=True):
                    q.put_nowait((i, ev))
            except Exception as e:  # deliberate boundary: any error ends the stream (anything but the pool's two
                q.put_nowait((i, e))  # refusals left `done` unsent, and the stream waited for ever)
            q.put_nowait((i, done))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            left = len(tasks)
            while left:
                i, ev = await q.get()
                if ev is done:
                    left -= 1
                elif isinstance(ev, Exception):
                    raise ev
                else:
                    yield i, ev
        finally:
            for t in tasks:
                t.cancel()
            for r in reqs:
                self.pool.take_reservation(r.request_id)

    def _usage(self, prompts: list[list[int]], outs: list[CompletionOutput]) -> Usage:
        p = sum(len(x) for x in prompts)
        c = sum(len(o.token_ids) for o in outs)  # generated_tokens_total counts them at the pool (ReplicaPool)
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def _count(self, endpoint: str, status: int, t0: float) -> None:
        self.m_requests.labels(endpoint, str(status)).inc()
        self.m_latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def _guard(self, endpoint: str, work: Any) -> Response:
        t0 = time.perf_counter()
        try:
            resp = await work
        except ApiError as e:
            self._count(endpoint, e.status, t0)
            self.m_rejected.labels(e.code or f"http_{e.status}").inc()
            return e.response()
        if not isinstance(resp, StreamingResponse):
            self._count(endpoint, 200, t0)
        return resp

    # ---- /v1/completions --------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._guard("completions", self._completions(request))

    async def _completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        params = self._params(req, req.max_tokens, req.logprobs)
        self._check_stop_ids(params)
        raw = req.prompt
        if isinstance(raw, str):
            prompts = await self.work.run(self._encode, [raw])
        elif raw and all(isinstance(x, int) for x in raw):
            prompts = [list(raw)]
        elif raw and all(isinstance(x, str) for x in raw):
            prompts = await self.work.run(self._encode, raw)
        else:
            prompts = [list(x) for x in raw]
        if not prompts:
            raise ApiError(400, "prompt is empty", param="prompt")
        if len(prompts) > self.config.max_prompts_per_batch:  # as gRPC BatchGenerate: prompts x n is bounded
            raise ApiError(400, f"{len(prompts)} prompts is over the limit of {self.config.max_prompts_per_batch}",
                           param="prompt")
        for i, p in enumerate(prompts):
            self._check_prompt(p, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        reqs = self._requests(prompts, params, req.n, "cmpl")
        rid = reqs[0].request_id.rsplit("-", 1)[0]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse("completions", t0, self._completion_stream(rid, reqs, prompts, params, req.n,
                                                                         include_usage), reqs)
        groups = await self._collect(reqs, request)

        def respond() -> JSONResponse:  # on a thread: n=64 x 300 tokens x 20 top logprobs took the loop for 7 s
            flat = [c for g in groups for c in g]
            choices = [conv.completion_choice(self.tokenizer, pi * req.n + c.sample_index, c, req.logprobs)
                       for pi, g in enumerate(groups) for c in g]
            return JSONResponse(CompletionResponse(
                id=rid, created=int(time.time()), model=self.model_name, choices=choices,
                usage=self._usage(prompts, flat), tlt_versions=conv.response_versions(flat)
            ).model_dump(exclude_none=True))

        return await self.work.run(respond)

    async def _completion_stream(self, rid: str, reqs: list[GenerationRequest], prompts: list[list[int]],
                                 params: SamplingParams, n: int, include_usage: bool) -> AsyncIterator[bytes]:
        streams: dict[int, conv.CompletionChoiceStream] = {}
        outs: list[CompletionOutput] = []
        created = int(time.time())
        nulls = ("usage",) if include_usage else ()  # OpenAI: the other chunks' usage is null

        def chunk(index: int, text: str, finish: str | None = None, lp: Any = None, versions: Any = None) -> bytes:
            return Sse.data(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[
                CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish, tlt_versions=versions)]),
                nulls)

        async with aclosing(self._merged(reqs)) as events:  # closed with this stream: its requests abort
            async for pi, ev in events:
                index = pi * n + ev.sample_index
                if index not in streams:  # decoded after its prompt's last tokens, as the engine decodes it
                    streams[index] = conv.CompletionChoiceStream(self.tokenizer, params.stop, params.logprobs,
                                                                 reqs[pi].prompt_token_ids)
                cs = streams[index]
                if isinstance(ev, StepOutput):
                    delta, lp = cs.push(ev)
                    if delta:
                        yield chunk(index, delta, lp=lp)
                else:
                    outs.append(ev)
                    text, lp = cs.finish(ev)
                    yield chunk(index, text, conv.finish_reason(ev), lp, conv.tlt_versions(ev.versions))
        if include_usage:
            yield Sse.data(CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                               usage=self._usage(prompts, outs),
                                               tlt_versions=conv.response_versions(outs)))

    def _sse(self, endpoint: str, t0: float, body: AsyncIterator[bytes],
             reqs: list[GenerationRequest]) -> StreamingResponse:
        """`body` as server-sent events. However the stream ends, `reqs` give back the admission places reserved
        for them (`_merged` does once their events begin; a client gone before that, during a chat stream's role
        chunks, left them held until they expired, 60 s)."""
        async def wrapped() -> AsyncIterator[bytes]:
            status = 200
            try:
                try:
                    async for b in body:
                        yield b
                except (ApiError, InvalidRequestError, ReplicaUnavailableError) as e:
                    err = e if isinstance(e, ApiError) else pool_error(e)  # as a non-streaming request's: same
                    status = err.status  # code, counted in rollout_rejected_total the same
                    self.m_rejected.labels(err.code or f"http_{err.status}").inc()
                    yield Sse.data(ErrorResponse(error=ErrorBody(message=err.message, type=err.type, code=err.code)))
                yield Sse.done
            except (GeneratorExit, asyncio.CancelledError):  # the client left mid-stream (its request is aborted as
                status = 499  # `body` closes): counted as a non-streaming request whose client leaves
                self.m_rejected.labels("client_closed").inc()
                raise
            except Exception as e:  # deliberate boundary: a bug inside a started stream ends it in the error shape
                status = 500
                log.exception("stream_failed", endpoint=endpoint)
                self.m_rejected.labels("internal_error").inc()
                yield Sse.data(ErrorResponse(error=ErrorBody(
                    message=f"internal error: {type(e).__name__}: {e}"[:500], type="server_error",
                    code="internal_error")))
                yield Sse.done
            finally:  # once, however the stream ends (it was counted only after its last chunk)
                self._count(endpoint, status, t0)
                for r in reqs:
                    self.pool.take_reservation(r.request_id)
                await body.aclose()  # type: ignore[attr-defined]  # its requests are aborted (`_merged`)

        return _ClosingStream(wrapped(), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- /v1/chat/completions ---------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._guard("chat", self._chat(request))

    async def _chat(self, request: Request) -> Response:
        t0 = time.perf_counter()
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        top = req.top_logprobs or 0
        params = self._params(req, max_tokens, top if req.logprobs else None)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
        self._check_stop_ids(params)
        ids = await self.work.run(self._chat_prompt, req)  # the template and tokenizer: off the loop
        self._check_prompt(ids, params, "the chat prompt",
                           "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                           "messages")
        tools = conv.tool_parsing(req, self.config.tool_call_parser)
        reqs = self._requests([ids], params, req.n, "chatcmpl")
        rid = reqs[0].request_id.rsplit("-", 1)[0]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._sse("chat", t0, self._chat_stream(rid, reqs, [ids], params, req, tools, include_usage), reqs)
        (outs,) = await self._collect(reqs, request)

        def respond() -> JSONResponse:  # on a thread, as a completion's: top logprobs cost the loop seconds
            choices = [conv.chat_choice(self.tokenizer, c.sample_index, c, req.logprobs, top, tools) for c in outs]
            return JSONResponse(ChatCompletionResponse(
                id=rid, created=int(time.time()), model=self.model_name, choices=choices,
                usage=self._usage([ids], outs), tlt_versions=conv.response_versions(outs)
            ).model_dump(exclude_none=True))

        return await self.work.run(respond)

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids: the model's chat template over the messages, and over the tools when given.

        A template that renders the same text with and without the tools ignores them (the tiny task template
        does): the model would never learn it has tools, and its calls could not be parsed; a 400 says so
        rather than a rollout that silently has no tools. Checked on this request's own messages (a template
        may render tools only beside a system message, say): one extra render without them, no tokenisation.
        The text is tokenised as apply_chat_template(tokenize=True) does: without adding special tokens."""
        messages = [m.for_template() for m in req.messages]
        tools = req.tools or None

        def render(with_tools: list[Any] | None) -> str:
            return self.tokenizer.apply_chat_template(messages, tools=with_tools, add_generation_prompt=True,
                                                      tokenize=False)

        try:
            text = render(tools)
            if tools is not None and text == render(None):
                raise ApiError(400, "this model's chat template does not render tools, so the model would not see "
                                    "them; use a checkpoint whose template does (Qwen2.5, Qwen3, Hermes), or send "
                                    "no tools", param="tools")
        except (TemplateError, ValueError) as e:  # the template's raise_exception: e.g. roles out of order
            raise ApiError(400, f"the model's chat template refused the messages: {e}", param="messages") from None
        try:
            return self.prompts.encode(text, self.pool.info.max_model_len, add_special_tokens=False)
        except PromptTooLong as e:
            raise ApiError(400, f"the chat prompt {e}", param="messages", code="context_length_exceeded") from None

    async def _chat_stream(self, rid: str, reqs: list[GenerationRequest], prompts: list[list[int]],
                           params: SamplingParams, req: ChatCompletionRequest, tools: conv.ToolParsing | None,
                           include_usage: bool) -> AsyncIterator[bytes]:
        created = int(time.time())
        streams: dict[int, conv.ChatChoiceStream] = {}
        outs: list[CompletionOutput] = []

        nulls = ("usage",) if include_usage else ()  # OpenAI: the other chunks' usage is null

        def chunk(choice: ChatChunkChoice) -> bytes:
            return Sse.data(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]),
                             nulls)

        for i in range(req.n):
            streams[i] = conv.ChatChoiceStream(self.tokenizer, i, params.stop, tools, bool(req.logprobs),
                                               req.top_logprobs or 0, reqs[0].prompt_token_ids)
            yield chunk(streams[i].start())
        async with aclosing(self._merged(reqs)) as events:  # closed with this stream: its requests abort
            async for _, ev in events:
                cs = streams[ev.sample_index]
                if isinstance(ev, StepOutput):
                    for choice in cs.push(ev):
                        yield chunk(choice)
                else:
                    outs.append(ev)
                    for choice in cs.finish(ev):
                        yield chunk(choice)
        if include_usage:
            yield Sse.data(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                                usage=self._usage(prompts, outs),
                                                tlt_versions=conv.response_versions(outs)))
