"""The gRPC `tlt.v1.Rollout` service (grpc.aio, on the same event loop as the HTTP API).

    BatchGenerate: prompts x n -> one GenerationRequest per prompt (seeded: prompt i's seed is
                   engine/sequence.py prompt_seed(seed, i)) -> a Completion streamed per sequence
                   as soon as it finishes (any order; prompt_index / sample_index say which)
    Generate:      one prompt x n -> all completions at once
    UpdateWeights: manifest + chunks -> assemble -> validate (checksum, sizes, names, shapes, dtypes vs the
                   engine's expected_weights) -> every replica applies it between two engine steps
    GetWeights:    names -> those tensors of the policy the replicas serve (as the pushes left them; a tensor no
                   push carried is the start checkpoint's) and its version, as manifest + chunks; the drafter
                   service fetches the target's embedding and lm_head with it after a policy update
    GetStatus:     per replica: state, running, queued, KV use, versions, SD status, alive; the dtype pushes must carry

Weight swaps and in-flight requests: requests are NOT paused, aborted or
restarted. A swap lands on each replica between two engine steps; sequences
already running continue with the new weights from the next step on (their KV
cache, computed by the old weights, is kept). The engine records the policy
version of every step that ran a sequence, prefill chunks included
(`services/rollout/engine/engine.py`); a Completion's `versions.policy` is the
NEWEST version that computed any of its tokens or prompt K/V. The oldest
(`Versions.policy_min`, set only for a sequence that straddled a swap) is
`versions.policy_min` over gRPC (unset otherwise: `HasField`) and
`tlt_versions.policy_min` over HTTP. The trainer pushes between rollout
phases, when nothing is in flight, so its completions never straddle.

Invalid requests get INVALID_ARGUMENT with the reason; a request the server
has no room for now (`max_pending_sequences`) gets RESOURCE_EXHAUSTED; a bad weight push
answers ok=false with the reason and changes nothing; a missing or wrong
control token on UpdateWeights or GetWeights gets UNAUTHENTICATED (policy: services/common/
auth.py). Every refusal counts in rollout_rejected_total{reason}.

Metrics (the server's one registry, served on the HTTP API's /metrics): every call counts once in
rollout_grpc_requests_total{method, code} with the status it ended with (OK, INVALID_ARGUMENT, CANCELLED, ...; a
weight push answered ok=false is OK there and counted by reason in rollout_rejected_total).
rollout_prompt_tokens_total and rollout_generated_tokens_total are counted for both APIs at the pool
(ReplicaPool.prompt_tokens: each prompt once, whatever n, as OpenAI's usage.prompt_tokens; generated_tokens at
each engine step: a BatchGenerate cancelled mid-way counts what its unfinished samples had generated too).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tlt.services.common.auth import ControlAuth
from tlt.services.common.logging import get_logger
from tlt.services.common.metrics import Metrics
from tlt.services.rollout.config import RolloutConfig
from tlt.services.rollout.engine.sequence import prompt_params
from tlt.services.rollout.errors import OverloadedError
from tlt.services.rollout.front_prompts import (
    PromptEncoder,
    PromptTooLong,
    RequestThreads,
    bad_stop_ids,
    kv_problem,
)
from tlt.services.rollout.lease import MAX_LEASE_S
from tlt.services.rollout.replicas import InvalidRequestError, ReplicaPool, ReplicaUnavailableError, WeightUpdateError
from tlt.services.rollout.types import CompletionOutput, FinishReason, GenerationRequest, SamplingParams
from tlt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

log = get_logger("rollout.grpc")

_FINISH = {
    FinishReason.STOP: rollout_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: rollout_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: rollout_pb2.FINISH_REASON_ABORT,
}
_KINDS = {common_pb2.WEIGHT_KIND_POLICY: "policy", common_pb2.WEIGHT_KIND_DRAFTER: "drafter"}


def sampling_params(p: rollout_pb2.SamplingParams) -> SamplingParams:
    """Proto params -> engine params (unset optional fields take the OpenAI defaults)."""
    params = SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else 0,
        min_p=p.min_p if p.HasField("min_p") else 0.0,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens or None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        return_features=p.return_features,
        reproducible=p.reproducible,
    )
    if p.max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (0: up to the context), got {p.max_tokens}")
    params.validate()
    return params


def completion_message(c: CompletionOutput, prompt_index: int, reference: str, hidden_size: int
                       ) -> rollout_pb2.Completion:
    msg = rollout_pb2.Completion(
        request_id=c.request_id,
        prompt_index=prompt_index,
        sample_index=c.sample_index,
        prompt_token_ids=c.prompt_token_ids,
        token_ids=c.token_ids,
        text=c.text,
        logprobs=c.logprobs or [],
        finish_reason=_FINISH[c.finish_reason],
        versions=common_pb2.WeightVersions(policy=c.versions.policy, drafter=c.versions.drafter,
                                           policy_min=c.versions.policy_min),
        spec=rollout_pb2.SpecStats(verify_steps=c.spec.verify_steps, accepted_tokens=c.spec.accepted_tokens,
                                   plain_decode_steps=c.spec.plain_decode_steps),
        replica_id=c.replica_id,
        error=c.error,
        reference=reference,
    )
    for alt in c.top_logprobs or []:
        msg.top_logprobs.add(token_ids=list(alt.keys()), logprobs=list(alt.values()))
    if c.features is not None:
        msg.features = c.features.tobytes()
        msg.hidden_size = hidden_size
    return msg


def _status(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status code a call ended with: the one set by `context.abort` (or `set_code`), CANCELLED for a call
    cancelled by its client or the server's stop (DEADLINE_EXCEEDED once its deadline passed), UNKNOWN for an
    exception grpc.aio answers as such, else OK."""
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        left = context.time_remaining()
        return "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if error is not None else "OK"


def counted(method: Callable) -> Callable:
    """Count each call of an RPC method once in rollout_grpc_requests_total{method, code} (`RolloutService._calls`),
    streaming ones (async generators) included."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self: "RolloutService", request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            inner, error = method(self, request, context), None
            try:
                async for item in inner:
                    yield item
            except BaseException as e:
                error = e
                raise
            finally:
                await inner.aclose()
                self._count_call(name, _status(context, error))
        return stream

    @functools.wraps(method)
    async def unary(self: "RolloutService", request: Any, context: grpc.aio.ServicerContext) -> Any:
        error = None
        try:
            return await method(self, request, context)
        except BaseException as e:
            error = e
            raise
        finally:
            self._count_call(name, _status(context, error))
    return unary




class RolloutService(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, pool: ReplicaPool, tokenizer: Any, model_name: str, config: RolloutConfig,
                 rejected: Any = None, metrics: Metrics | None = None, work: RequestThreads | None = None) -> None:
        """`metrics`: the server's registry (rollout_grpc_requests_total is made on it); `rejected`: the HTTP API's
        counter of that registry, which gRPC refusals add to; `work`: the threads prompts are tokenised on (the
        server shares one set between its two APIs)."""
        self.pool, self.tokenizer, self.model_name, self.config = pool, tokenizer, model_name, config
        self.prompts = PromptEncoder(tokenizer)  # text -> ids, bounded by the context (front_prompts.py)
        self.work = work or RequestThreads()
        self.auth = ControlAuth.build(config.host, config.control_token, config.insecure_local)
        self.rejected = rejected  # Counter tlt rollout_rejected_total{reason}, shared with the HTTP API
        self._calls = None if metrics is None else metrics.counter(
            "grpc_requests_total", "gRPC calls by method and the status code they ended with (refusals are "
            "also in rejected_total by reason)", ("method", "code"))

    def _reject(self, reason: str) -> None:
        if self.rejected is not None:
            self.rejected.labels(reason).inc()

    def _count_call(self, method: str, code: str) -> None:
        if self._calls is not None:
            self._calls.labels(method, code).inc()

    # ---- generation ------------------------------------------------------------------------

    async def _requests(self, prompts: Any, n: int, p: rollout_pb2.SamplingParams, prefix: str
                        ) -> list[GenerationRequest]:
        """Validate and convert; raises ValueError with a message for INVALID_ARGUMENT."""
        n = n or 1
        if not 1 <= n <= self.config.max_n:
            raise ValueError(f"n must be between 1 and {self.config.max_n}, got {n}")
        if not prompts:
            raise ValueError("no prompts given")
        if len(prompts) > self.config.max_prompts_per_batch:
            raise ValueError(f"{len(prompts)} prompts is over the limit of {self.config.max_prompts_per_batch}")
        params = sampling_params(p)
        info = self.pool.info
        # Off the event loop: a slow tokenizer takes ~2 s a MB of text, and a message may hold 256 MB; on the loop
        # it froze every other call, /health included, before the prompt was refused for its length.
        # A text that cannot fit is refused without tokenising it whole (front_prompts.py: memory grew ~280 bytes a
        # character). The stop ids once a request, not once a prompt.
        stop_problem = bad_stop_ids(params.stop_token_ids, info.vocab_size)
        if stop_problem:
            raise ValueError(stop_problem)
        texts = {i: prompt.text for i, prompt in enumerate(prompts) if prompt.WhichOneof("input") == "text"}
        encoded = await self.work.run(self._encode_texts, texts) if texts else {}  # token ids: no thread hop
        out = []
        for i, prompt in enumerate(prompts):
            kind = prompt.WhichOneof("input")
            if kind == "text":
                ids = encoded[i]
            elif kind == "token_ids":
                ids = list(prompt.token_ids.ids)
            else:
                raise ValueError(f"prompt {i} has neither text nor token_ids")
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= info.max_model_len:  # before the per-token check: a huge prompt is refused at once
                raise ValueError(f"prompt {i} has {len(ids)} tokens; the context length is {info.max_model_len}")
            if any(not 0 <= t < info.vocab_size for t in ids):
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {info.vocab_size})")
            if params.max_tokens is not None and len(ids) + params.max_tokens > info.max_model_len:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + max_tokens {params.max_tokens} is over the "
                                 f"context length {info.max_model_len}")
            if problem := kv_problem(len(ids), params.max_tokens, info.max_model_len, info.kv_capacity_tokens,
                                     f"prompt {i}", "max_tokens"):
                raise ValueError(problem)
            # its own seed (prompt 0: the request's), not the request's for every prompt: their samples would be alike
            out.append(GenerationRequest(f"{prefix}-{i}", tuple(ids), prompt_params(params, i),
                                         n))
        self.pool.admit(len(out) * n)  # InvalidRequestError (alone too large) is a ValueError; OverloadedError: busy
        return out

    def _encode_texts(self, texts: dict[int, str]) -> dict[int, list[int]]:
        """Prompt index -> token ids of each text prompt (blocking: on a thread); ValueError names a prompt that
        cannot fit the context."""
        limit, out = self.pool.info.max_model_len, {}
        for i, text in texts.items():
            try:
                out[i] = self.prompts.encode(text, limit)
            except PromptTooLong as e:
                raise ValueError(f"prompt {i} {e}") from None
        return out

    async def _refuse_overloaded(self, e: OverloadedError, context: grpc.aio.ServicerContext) -> None:
        self._reject("overloaded")
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def _stream(self, reqs: list[GenerationRequest], refs: list[str]
                      ) -> AsyncIterator[rollout_pb2.Completion]:
        q: asyncio.Queue = asyncio.Queue()
        done = object()
        hidden = self.pool.info.hidden_size

        async def pump(i: int, r: GenerationRequest) -> None:
            try:
                async for c in self.pool.generate(r):
                    if isinstance(c, CompletionOutput):
                        q.put_nowait(completion_message(c, i, refs[i], hidden))
            except Exception as e:  # deliberate boundary: any error ends the call; `done` alone never came and the
                q.put_nowait(e)  # call waited for ever (InvalidRequestError / ReplicaUnavailableError: mapped below)
            q.put_nowait(done)

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            left = len(tasks)
            while left:
                item = await q.get()
                if item is done:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    @counted
    async def BatchGenerate(self, request: rollout_pb2.BatchGenerateRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[rollout_pb2.Completion]:
        batch_id = request.batch_id or uuid.uuid4().hex
        try:
            reqs = await self._requests(request.prompts, request.n, request.params,
                                        f"{batch_id}-{uuid.uuid4().hex[:8]}")
        except ValueError as e:
            self._reject("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OverloadedError as e:
            await self._refuse_overloaded(e, context)
        try:
            async for msg in self._stream(reqs, [p.reference for p in request.prompts]):
                yield msg
        except InvalidRequestError as e:
            self._reject("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ReplicaUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    @counted
    async def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> rollout_pb2.GenerateResponse:
        rid = request.request_id or uuid.uuid4().hex
        try:
            reqs = await self._requests([request.prompt], request.n, request.params, f"{rid}-{uuid.uuid4().hex[:8]}")
        except ValueError as e:
            self._reject("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except OverloadedError as e:
            await self._refuse_overloaded(e, context)
        try:
            outs = [m async for m in self._stream(reqs, [request.prompt.reference])]
        except InvalidRequestError as e:
            self._reject("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ReplicaUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        outs.sort(key=lambda m: m.sample_index)
        return rollout_pb2.GenerateResponse(completions=outs)

    # ---- control -------------------------------------------------------------------------

    @counted
    async def UpdateWeights(self, request_iterator: AsyncIterator[rollout_pb2.WeightChunk],
                            context: grpc.aio.ServicerContext) -> rollout_pb2.UpdateWeightsResponse:
        from tlt.services.common.weights import WeightValidationError, assemble

        why = self.auth.check(context.invocation_metadata())
        if why is not None:
            self._reject("unauthenticated")
            log.warning("control_call_refused", method="UpdateWeights", reason=why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"UpdateWeights: {why}")
        chunks = []
        received = 0
        async for chunk in request_iterator:
            received += len(chunk.data)
            if received > self.config.max_weight_bytes:
                self._reject("weights_too_large")
                return rollout_pb2.UpdateWeightsResponse(
                    ok=False, error=f"weight stream is over max_weight_bytes={self.config.max_weight_bytes}")
            chunks.append(chunk)
        try:
            # a worker thread: joining the chunks (or reading the shm file) of a large model takes seconds
            manifest, payload = await asyncio.to_thread(assemble, chunks, max_total_bytes=self.config.max_weight_bytes)
        except WeightValidationError as e:
            self._reject("weights_invalid")
            return rollout_pb2.UpdateWeightsResponse(ok=False, error=str(e))
        kind = _KINDS.get(manifest.kind)
        if kind is None:
            self._reject("weights_invalid")
            return rollout_pb2.UpdateWeightsResponse(ok=False, error="manifest kind must be POLICY or DRAFTER")
        try:
            result = await self.pool.update_weights(kind, manifest, payload, self.config.update_timeout_s)
        except (WeightUpdateError, ReplicaUnavailableError) as e:
            log.warning("weight_update_rejected", kind=kind, version=manifest.version, error=str(e)[:500])
            self._reject("weights_rejected")
            v = self.pool.versions  # what still serves: a caller compares it with its push (stale or not)
            return rollout_pb2.UpdateWeightsResponse(ok=False, error=str(e), kind=manifest.kind,
                                                     version=v.policy if kind == "policy" else v.drafter)
        v = result["versions"]
        return rollout_pb2.UpdateWeightsResponse(
            ok=True, kind=manifest.kind, version=v.policy if kind == "policy" else v.drafter,
            apply_seconds=result["seconds"], replicas=result["replicas"])

    @counted
    async def GetWeights(self, request: rollout_pb2.GetWeightsRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[rollout_pb2.WeightChunk]:
        from tlt.services.common.weights import iter_chunks

        why = self.auth.check(context.invocation_metadata())
        if why is not None:
            self._reject("unauthenticated")
            log.warning("control_call_refused", method="GetWeights", reason=why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"GetWeights: {why}")
        if request.kind != common_pb2.WEIGHT_KIND_POLICY or not request.names:
            self._reject("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "GetWeights serves kind=WEIGHT_KIND_POLICY and needs at least one tensor name")
        latest, version = self.pool.latest_push("policy"), self.pool.versions.policy  # together, on the loop
        names = list(dict.fromkeys(request.names))
        try:  # copying ~1 GB and hashing it takes a while: off the event loop
            manifest, payload = await asyncio.to_thread(policy_weights, self.pool.model_dir, latest, version, names)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        for chunk in iter_chunks(manifest, payload):
            yield chunk

    @counted
    async def LendDevices(self, request: rollout_pb2.LendRequest, context: grpc.aio.ServicerContext
                          ) -> rollout_pb2.LendResponse:
        """Colocated placement: lend the replicas' devices to the trainer, or take them back (lease.py)."""
        why = self.auth.check(context.invocation_metadata())
        if why is not None:
            self._reject("unauthenticated")
            log.warning("control_call_refused", method="LendDevices", reason=why)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"LendDevices: {why}")
        if request.lend and not 0 < request.lease_s <= MAX_LEASE_S:
            self._reject("invalid_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"LendDevices: lease_s must be in (0, {MAX_LEASE_S:g}], got {request.lease_s}")
        try:
            if request.lend:
                r = await self.pool.lend(request.holder, request.lease_s, self.config.update_timeout_s)
            else:
                r = await self.pool.take_back(self.config.update_timeout_s)
        except (WeightUpdateError, TimeoutError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"LendDevices: {e or 'a replica did not answer in time'}")
        return rollout_pb2.LendResponse(lent=bool(self.pool.lent_to), expires_in_s=r["expires_in_s"],
                                        replicas=r["replicas"], seconds=r["seconds"])

    @counted
    async def GetStatus(self, request: rollout_pb2.StatusRequest, context: grpc.aio.ServicerContext
                        ) -> rollout_pb2.RolloutStatus:
        status = rollout_pb2.RolloutStatus(
            model=self.model_name, backend=self.config.backend, lent_to=self.pool.lent_to,
            versions=common_pb2.WeightVersions(policy=self.pool.versions.policy, drafter=self.pool.versions.drafter),
            control_refused=self.auth.check(context.invocation_metadata()) or "", dtype=push_dtype(self.pool.info))
        snapshot = await self.pool.snapshot()  # a stats query waits behind a resume in the replica's pipe
        lease = self.pool.lease  # a replica that has not answered its resume is still LENT (its capacity events)
        resuming = {rep.replica_id for rep in lease.resuming} if lease is not None else set()
        for s in snapshot:
            r = status.replicas.add(replica_id=s.replica_id, device=s.device, alive=s.alive)
            if s.stats is None:  # dead (DRAINING, as its capacity events say) or not answering in time
                r.state = common_pb2.REPLICA_STATE_UNSPECIFIED if s.alive else common_pb2.REPLICA_STATE_DRAINING
                continue
            busy = s.stats.running or s.stats.queued or s.outstanding
            lent = status.lent_to or s.replica_id in resuming
            rest = common_pb2.REPLICA_STATE_LENT if lent else common_pb2.REPLICA_STATE_IDLE
            r.state = common_pb2.REPLICA_STATE_BUSY if busy else rest
            r.running, r.queued, r.kv_usage = s.stats.running, s.stats.queued, s.stats.kv_usage
            r.versions.policy, r.versions.drafter = s.stats.versions.policy, s.stats.versions.drafter
            r.spec.CopyFrom(spec_status(s.stats.spec, self.config.spec.mode if self.config.backend == "native" else ""))
        return status


def push_dtype(info: Any) -> str:
    """The dtype every pushed policy tensor must have (the pool validates pushes against `expected_weights`);
    "" when the tensors differ or nothing is known yet."""
    dtypes = {d for _, d in getattr(info, "expected_weights", {}).values()}
    return dtypes.pop() if len(dtypes) == 1 else ""


def policy_weights(model_dir: str, latest: tuple[int, bytes, bytes] | None, start_version: int,
                   names: list[str]) -> tuple[rollout_pb2.WeightManifest, bytearray]:
    """The named policy tensors the replicas serve, packed, under the version they serve: each from the latest
    applied push `latest` (version, manifest, payload: every tensor any push carried) when a push carried it, else
    from the checkpoint folder they started from, which no push overwrote. KeyError names those in neither.

    A tied model's (tie_word_embeddings) lm_head.weight is the embedding it serves: a head its checkpoint also
    stores is the start one, stale once a push changed the embedding (no push keeps a tied head: the pool drops it)."""
    from tlt.model.folder import CheckpointError, ties_word_embeddings
    from tlt.model.loader import EMBEDDING, TIED_HEAD
    from tlt.services.common.weights import pack_state_dict, unpack

    try:
        tied = TIED_HEAD in names and ties_word_embeddings(model_dir)
    except CheckpointError as e:
        raise KeyError(str(e)) from None
    if not tied:
        return _served_weights(model_dir, latest, start_version, names)
    sources = [EMBEDDING if n == TIED_HEAD else n for n in names]
    manifest, payload = _served_weights(model_dir, latest, start_version, list(dict.fromkeys(sources)))
    tensors = unpack(manifest, payload)
    return pack_state_dict({n: tensors[src] for n, src in zip(names, sources)}, common_pb2.WEIGHT_KIND_POLICY,
                           manifest.version)


def _served_weights(model_dir: str, latest: tuple[int, bytes, bytes] | None, start_version: int,
                    names: list[str]) -> tuple[rollout_pb2.WeightManifest, bytearray]:
    """policy_weights, each name as it is stored: pushed, else in the start checkpoint."""
    from tlt.model.loader import CheckpointError, read_tensors
    from tlt.services.common.weights import merge, pack_state_dict, select

    pushed = None if latest is None else rollout_pb2.WeightManifest.FromString(latest[1])
    held = set() if pushed is None else {s.name for s in pushed.tensors}
    rest = [n for n in names if n not in held]
    version = start_version if latest is None else latest[0]
    if pushed is not None and not rest:
        return select(pushed, latest[2], names)
    try:
        tensors = read_tensors(model_dir, rest)
    except CheckpointError as e:
        raise KeyError(str(e)) from None
    manifest, payload = pack_state_dict({n: tensors[n] for n in rest}, common_pb2.WEIGHT_KIND_POLICY, version)
    if pushed is None:
        return manifest, payload
    manifest, merged = merge(manifest, payload, *select(pushed, latest[2], [n for n in names if n in held]))
    return select(manifest, merged, names)  # in the order asked, as when one source holds them all


def spec_status(sp: dict, configured_mode: str = "") -> rollout_pb2.SpecStatus:
    """The engine's speculative-decoding stats dict (empty: no decoder attached) -> SpecStatus."""
    if not sp:
        return rollout_pb2.SpecStatus(mode="off")
    arm = sp.get("arm", sp.get("last_arm"))
    return rollout_pb2.SpecStatus(
        mode=str(sp.get("mode") or configured_mode or "unknown"),
        active=bool(sp.get("active", sp.get("on", False))),
        arm="" if arm is None else str(arm),
        mean_accept_len=float(sp.get("mean_accept_len", 0.0)),
        last_step_seconds=float(sp.get("last_step_seconds", 0.0)),
        verify_steps=int(sp.get("verify_steps", 0)),
        plain_steps=int(sp.get("plain_steps", 0)),
        no_room=int(sp.get("no_room", 0)),
        over_budget=int(sp.get("over_budget", 0)),
        switches=int(sp.get("switches", 0)),
        bandit=[rollout_pb2.BanditBucket(
            bucket=b["bucket"], explored=b["explored"], exploited=b["exploited"],
            arms=[rollout_pb2.BanditArm(arm=a["arm"], samples=a["samples"], median_reward=a["median_reward"] or 0.0,
                                        chosen=a["chosen"]) for a in b["arms"]])
            for b in sp.get("bandit", [])],
        arms=[rollout_pb2.ArmCount(arm=name, steps=a["verify_steps"],
                                   accept_len=a["emitted"] / a["seq_steps"] if a["seq_steps"] else 0.0)
              for name, a in sp.get("arms", {}).items()],
    )
