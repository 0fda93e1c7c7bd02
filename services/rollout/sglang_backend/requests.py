"""What the adapter sends to SGLang and how it reads what comes back (pure, no SGLang import).

    GenerationRequest (n samples) -> n GenerateCall (one SGLang rid per sample)
    SGLang stream chunk (dict)    -> StreamChunk (typed; cumulative ids, logprobs)
    (kind, tensors, version)      -> TensorUpdateCall (selector "target" | "draft")

Each call is a frozen dataclass with the exact field names of the SGLang
0.5.23 message it becomes (`sglang/srt/managers/io_struct.py`:
`GenerateReqInput`, `UpdateWeightsFromTensorReqInput`; sampling keys are
fields of `sglang/srt/sampling/sampling_params.py::SamplingParams`). The
conversion to the real objects happens in `client.py`, and the contract test
builds them from these calls wherever SGLang imports.

The chunk layout is what `TokenizerManager._handle_batch_output`
(`sglang/srt/managers/tokenizer_manager.py`) yields for a streamed request
with `incremental_streaming_output = False`: `output_ids` and
`meta_info["output_token_logprobs"]` ([(logprob, token_id, text|None)]) are
cumulative; `meta_info["finish_reason"]` is None until the end, then a dict
whose "type" is "stop", "length" or "abort".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tlt.services.rollout.engine.sequence import seed_for
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams

Selector = Literal["target", "draft"]

# SGLang's rid of sample i of a TLT request; "#" cannot appear in TLT ids
# built by the servers (uuid hex / batch ids), and is checked in add_request.
SAMPLE_SEP = "#"


@dataclass(frozen=True)
class GenerateCall:
    """One `GenerateReqInput` (a single sample; stream = True)."""

    rid: str
    input_ids: tuple[int, ...]
    sampling_params: tuple[tuple[str, Any], ...]  # SamplingParams fields, as (name, value)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_hidden_states: bool = False
    stream: bool = True

    def sampling_dict(self) -> dict[str, Any]:
        return dict(self.sampling_params)


@dataclass(frozen=True)
class TensorUpdateCall:
    """One `UpdateWeightsFromTensorReqInput` inside a begin/end weight-update session."""

    selector: Selector
    names: tuple[str, ...]
    weight_version: str | None  # SGLang's server-wide weight version: the policy's; None leaves it as it is
    flush_cache: bool = False  # the session flushes once, after end_weight_update


@dataclass
class StreamChunk:
    """One streamed update of one SGLang request, parsed."""

    rid: str
    output_ids: list[int]  # every token so far
    logprobs: list[float] | None  # chosen-token logprobs so far
    top_logprobs: list[dict[int, float]] | None
    finish: FinishReason | None
    text: str | None
    hidden_states: Any | None  # list of per-token vectors, when asked
    spec_verify_ct: int = 0
    completion_tokens: int = 0
    error: str = ""
    short: bool = False  # an abort answer with fewer ids than completion_tokens whose logprobs could not fill them


def sample_rid(request_id: str, sample_index: int) -> str:
    return f"{request_id}{SAMPLE_SEP}{sample_index}"


def split_rid(rid: str) -> tuple[str, int]:
    request_id, _, index = rid.rpartition(SAMPLE_SEP)
    return request_id, int(index)


def sglang_sampling(params: SamplingParams, sample_index: int, default_max_tokens: int) -> dict[str, Any]:
    """TLT sampling params -> SGLang `SamplingParams` keyword arguments.

    top_k <= 0 means "no top-k" in TLT; SGLang's default (TOP_K_ALL) means the
    same, so the key is left out. A seeded request gives sample i the native
    engine's key for it (`seed_for`, below 2**63 for SGLang's int64), so the n samples differ and
    requests of adjacent seeds share none (seed + i gave seeds 5 and 6 three of four); SGLang honours `sampling_seed` only in
    its deterministic-inference mode (`[sglang] deterministic_inference`,
    checked in SGLang's sampling_batch_info / sampler), else it is dropped.
    """
    out: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "min_p": float(params.min_p),
        "max_new_tokens": int(params.max_tokens or default_max_tokens),
        "ignore_eos": bool(params.ignore_eos),
        # Stop strings are matched on text and trimmed by SGLang, like the native engine.
        "skip_special_tokens": True,
    }
    if params.top_k > 0:
        out["top_k"] = int(params.top_k)
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = sorted(set(params.stop_token_ids))
    if params.seed is not None:
        out["sampling_seed"] = seed_for(int(params.seed), sample_index) % 2**63
    return out


def generate_calls(req: GenerationRequest, default_max_tokens: int, features_enabled: bool) -> list[GenerateCall]:
    """The per-sample calls of one TLT request: its n samples, or the `sample_indices` the replica pool re-issues
    after a replica died, each with its own index and so its own seed."""
    if SAMPLE_SEP in req.request_id:
        raise ValueError(f"request_id must not contain {SAMPLE_SEP!r}: {req.request_id!r}")
    req.params.validate()
    if req.params.return_features and not features_enabled:
        raise ValueError("return_features needs [sglang] return_hidden_states = true")
    logprobs = req.params.logprobs
    return [
        GenerateCall(
            rid=sample_rid(req.request_id, i),
            input_ids=tuple(req.prompt_token_ids),
            sampling_params=tuple(sglang_sampling(req.params, i, default_max_tokens).items()),
            return_logprob=logprobs is not None,
            top_logprobs_num=int(logprobs or 0),
            return_hidden_states=bool(req.params.return_features),
        )
        for i in req.samples
    ]


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def parse_chunk(out: Mapping[str, Any]) -> StreamChunk:
    """One dict yielded by SGLang's generate stream -> StreamChunk."""
    meta = out.get("meta_info", {})
    finish_raw = meta.get("finish_reason")
    finish = None
    error = ""
    if finish_raw is not None:
        kind = finish_raw.get("type") if isinstance(finish_raw, Mapping) else str(finish_raw)
        finish = _FINISH.get(str(kind), FinishReason.ABORT)
        if finish is FinishReason.ABORT and isinstance(finish_raw, Mapping):
            error = str(finish_raw.get("message", "aborted by SGLang"))
    logprobs = None
    if "output_token_logprobs" in meta:
        logprobs = [float(item[0]) for item in meta["output_token_logprobs"]]
    top = None
    if meta.get("output_top_logprobs"):
        top = [{int(tok): float(lp) for lp, tok, *_ in (alts or [])} for alts in meta["output_top_logprobs"]]
    ids = [int(t) for t in out.get("output_ids", [])]
    completion = int(meta.get("completion_tokens", len(ids)) or 0)
    lp_items = meta.get("output_token_logprobs") or []
    short = completion > len(ids)  # TokenizerManager._handle_abort_req answers a streamed request with its last id
    if short and len(lp_items) == completion:  # its (logprob, id, text) entries hold every id
        ids, short = [int(item[1]) for item in lp_items], False
    return StreamChunk(
        rid=str(meta["id"]),
        output_ids=ids,
        logprobs=logprobs,
        top_logprobs=top,
        finish=finish,
        text=out.get("text"),
        hidden_states=meta.get("hidden_states"),
        spec_verify_ct=int(meta.get("spec_verify_ct", 0) or 0),
        completion_tokens=completion,
        error=error,
        short=short,
    )


def tensor_update_call(kind: str, names: list[str], version: int) -> TensorUpdateCall:
    """Policy pushes go to SGLang's target runner, drafter pushes to its draft runner."""
    if kind == "policy":
        return TensorUpdateCall(selector="target", names=tuple(names), weight_version=str(version))
    if kind == "drafter":
        shared = [n for n in names if _is_shared_with_target(n)]
        if shared:
            # The drafter shares the target's embed_tokens / lm_head; pushing them
            # as "draft" weights would overwrite the policy's copy (TLT.md section 6).
            raise ValueError(f"a drafter update must not carry the target's shared weights: {shared}")
        # None: SGLang's weight_version is server-wide (its server info, its outputs' version spans) and names the
        # policy; a drafter push that set it made SGLang report the drafter's version as the policy's
        return TensorUpdateCall(selector="draft", names=tuple(names), weight_version=None)
    raise ValueError(f"unknown weight kind {kind!r}; expected 'policy' or 'drafter'")


def sglang_drafter_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """TLT drafter state dict -> the names SGLang's EAGLE draft model loads.

    SGLang's EAGLE drafts (`sglang/srt/models/qwen2_eagle.py`, `llama_eagle.py`)
    keep the EAGLE checkpoint layout: `fc` (an nn.Linear(2H, H) WITH a bias) and
    one decoder layer at `layers.0.*`; their `load_weights` adds the `model.`
    prefix. TLT's drafter (tlt/model/drafter.py) names its layer `layer.*` and
    its fc has no bias, so the layer is renamed and a zero `fc.bias` is sent:
    the SGLang drafter then computes exactly TLT's function. Names already in
    SGLang's layout pass through unchanged.
    """
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        out["layers.0." + name[len("layer."):] if name.startswith("layer.") else name] = t
    if "fc.weight" in out and "fc.bias" not in out:
        w = out["fc.weight"]
        out["fc.bias"] = w.new_zeros(w.shape[0])
    return out


def _is_shared_with_target(name: str) -> bool:
    return name.endswith("embed_tokens.weight") or name.startswith("lm_head.") or ".lm_head." in name


@dataclass
class SampleState:
    """What the adapter has already emitted for one SGLang rid."""

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    policy_version: int
    drafter_version: int
    spanned_policy_update: bool = False
    # What was streamed so far, kept because SGLang's last message of an aborted sample may not repeat it:
    # TokenizerManager._handle_abort_req sends only the last id of a streamed request, and a stream that
    # raises ends with none.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    text: str = ""
