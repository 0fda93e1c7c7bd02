"""The adapter's view of one SGLang engine: a small synchronous interface and its real implementation.

    SGLangEngine (adapter) --SGLangClient--> EngineClient --io_struct--> sglang.Engine's TokenizerManager

`SGLangClient` is the process boundary the tests fake (SGLang needs a CUDA
GPU). `EngineClient` is the real one: it owns an in-process `sglang.Engine`
and drives its asyncio loop (`engine.loop`) from the replica's synchronous
loop: `poll()` runs the loop for a bounded slice while the request streams
progress, and every control call is one `run_until_complete`.

SGLang 0.5.23 API used (file: symbol):
- sglang/srt/entrypoints/engine.py: `Engine(**server_args)`, `engine.loop`,
  `engine.tokenizer_manager`, `engine.shutdown()`; `Engine.update_weights_from_tensor`
  takes no selector, so the adapter builds `UpdateWeightsFromTensorReqInput`
  itself and serializes per TP rank as `Engine._serialize_tensors_per_rank` does
  (`MultiprocessingSerializer.serialize(named_tensors)` once per rank).
- sglang/srt/managers/tokenizer_manager.py: `generate_request(obj, None)` (async
  generator of chunks), `abort_request(rid=...)`, `pause_generation(PauseGenerationReqInput)`,
  `continue_generation(ContinueGenerationReqInput)`.
- sglang/srt/managers/tokenizer_control_mixin.py: `begin_weight_update`,
  `end_weight_update`, `update_weights_from_tensor` (each `(obj, None) -> (ok, msg)`),
  `flush_cache()` (-> FlushCacheReqOutput; fails while any request waits or runs, retracted
  ones included: `Scheduler.flush_cache` needs `is_fully_idle()`),
  `release_memory_occupation(obj, None)`, `resume_memory_occupation(obj, None)`.
- sglang/srt/managers/scheduler_components/weight_updater.py: tensor updates are
  refused outside a begin/end session; `selector` picks the target or draft runner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from tlt.services.rollout.sglang_backend.requests import (
    GenerateCall,
    Selector,
    StreamChunk,
    TensorUpdateCall,
    parse_chunk,
)
from tlt.services.rollout.types import FinishReason

PauseMode = Literal["abort", "retract", "in_place"]


class SGLangError(RuntimeError):
    """SGLang refused a control call; the message is SGLang's."""


class SGLangClient(Protocol):
    def submit(self, call: GenerateCall) -> None: ...
    def poll(self, timeout_s: float) -> list[StreamChunk]: ...
    def abort(self, rid: str) -> None: ...
    def pause_generation(self, mode: PauseMode) -> None: ...
    def continue_generation(self) -> None: ...
    def begin_weight_update(self, selector: Selector) -> None: ...
    def update_weights_from_tensor(self, call: TensorUpdateCall, tensors: Sequence[tuple[str, Any]]) -> None: ...
    def end_weight_update(self) -> None: ...
    def flush_cache(self) -> None: ...
    def release_memory_occupation(self, tags: Sequence[str]) -> None: ...
    def resume_memory_occupation(self, tags: Sequence[str]) -> None: ...
    def shutdown(self) -> None: ...


# -- conversions to SGLang's own messages (imported lazily: the extra is optional) --


def to_generate_req_input(call: GenerateCall) -> Any:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(
        rid=call.rid,
        input_ids=list(call.input_ids),
        sampling_params=call.sampling_dict(),
        return_logprob=call.return_logprob,
        top_logprobs_num=call.top_logprobs_num,
        return_hidden_states=call.return_hidden_states,
        stream=call.stream,
    )


def to_update_req_input(call: TensorUpdateCall, serialized_per_rank: list[bytes]) -> Any:
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    return UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=serialized_per_rank,
        flush_cache=call.flush_cache,
        weight_version=call.weight_version,
        selector=call.selector,
    )


def serialize_per_rank(tensors: Sequence[tuple[str, Any]], tp_size: int) -> list[bytes]:
    from sglang.srt.utils import MultiprocessingSerializer

    named = list(tensors)
    return [MultiprocessingSerializer.serialize(named) for _ in range(tp_size)]


class EngineClient:
    """The real client over an in-process `sglang.Engine` (GPU only); `launch` starts one.

    The constructor takes the engine object itself (anything with SGLang's
    `tokenizer_manager`, `loop` and `shutdown`), so the asyncio pump below is
    tested against a stand-in TokenizerManager on a CPU.
    """

    @classmethod
    def launch(cls, engine_kwargs: dict[str, Any]) -> EngineClient:
        try:
            import sglang
        except ImportError as e:
            raise ModuleNotFoundError(
                f"--backend sglang needs SGLang 0.5.23 on a CUDA machine: pip install 'tlt[sglang]' "
                f"or use the tlt:sglang image (docs/DEPLOY.md) ({e})"
            ) from e

        return cls(sglang.Engine(**engine_kwargs), tp_size=int(engine_kwargs.get("tp_size", 1)))

    def __init__(self, engine: Any, tp_size: int = 1) -> None:
        self._tp_size = tp_size
        self._engine = engine
        self._tm = self._engine.tokenizer_manager
        self._loop: asyncio.AbstractEventLoop = self._engine.loop
        self._chunks: list[StreamChunk] = []
        self._wake = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    @staticmethod
    def _check(result: Any, what: str) -> None:
        # Session and update calls answer (success, message); flush_cache answers a
        # FlushCacheReqOutput(success, message) (tokenizer_control_mixin.flush_cache).
        if isinstance(result, tuple):
            ok, message = result[0], result[1] if len(result) > 1 else ""
        else:
            ok, message = getattr(result, "success", True), getattr(result, "message", "")
        if not ok:
            raise SGLangError(f"SGLang {what} failed: {message}")

    async def _consume(self, call: GenerateCall) -> None:
        try:
            async for out in self._tm.generate_request(to_generate_req_input(call), None):
                self._chunks.append(parse_chunk(out))
                self._wake.set()
        except (Exception, asyncio.CancelledError) as e:  # deliberate request boundary, see below
            # SGLang refuses a bad request by raising (ValueError, or fastapi.HTTPException from
            # TokenizerManager._handle_abort_finish_reason); the sample must end as aborted with
            # the reason, never hang the replica or take the other samples down.
            self._chunks.append(StreamChunk(call.rid, [], None, None, FinishReason.ABORT, None, None, error=str(e)))
            self._wake.set()
        finally:
            self._tasks.pop(call.rid, None)

    async def _wait(self, timeout_s: float) -> None:
        if not self._chunks:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout_s)
            except TimeoutError:
                pass
        self._wake.clear()

    def submit(self, call: GenerateCall) -> None:
        self._tasks[call.rid] = self._loop.create_task(self._consume(call))

    def poll(self, timeout_s: float) -> list[StreamChunk]:
        self._run(self._wait(timeout_s))
        chunks, self._chunks = self._chunks, []
        return chunks

    def abort(self, rid: str) -> None:
        self._tm.abort_request(rid=rid)

    def pause_generation(self, mode: PauseMode) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._run(self._tm.pause_generation(PauseGenerationReqInput(mode=mode)))

    def continue_generation(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._run(self._tm.continue_generation(ContinueGenerationReqInput()))

    def begin_weight_update(self, selector: Selector) -> None:
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self._check(self._run(self._tm.begin_weight_update(BeginWeightUpdateReqInput(selector=selector), None)), "begin_weight_update")

    def update_weights_from_tensor(self, call: TensorUpdateCall, tensors: Sequence[tuple[str, Any]]) -> None:
        obj = to_update_req_input(call, serialize_per_rank(tensors, self._tp_size))
        self._check(self._run(self._tm.update_weights_from_tensor(obj, None)), f"update_weights_from_tensor({call.selector})")

    def end_weight_update(self) -> None:
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self._check(self._run(self._tm.end_weight_update(EndWeightUpdateReqInput(), None)), "end_weight_update")

    def flush_cache(self) -> None:
        self._check(self._run(self._tm.flush_cache()), "flush_cache")

    def release_memory_occupation(self, tags: Sequence[str]) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self._run(self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=list(tags)), None))

    def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self._run(self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=list(tags)), None))

    def shutdown(self) -> None:
        self._engine.shutdown()
