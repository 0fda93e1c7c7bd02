"""The SGLang backend adapter: what it sends to SGLang and how it sequences it.

Faked here: SGLang's engine (it needs a CUDA GPU and is an optional extra that
is never installed by default). `FakeSGLang` stands in for the `SGLangClient`
boundary only: it records every call in order and replays stream chunks laid
out exactly as SGLang 0.5.23's TokenizerManager yields them (cumulative
`output_ids`, `meta_info.output_token_logprobs` as (logprob, id, text)
triples, `finish_reason` dicts). Everything above that boundary (request
building, stream slicing, completions, weight-update sessions, release /
resume with the drafter re-push, stats) is the real adapter.

The real `EngineClient` (the asyncio pump that drives SGLang's TokenizerManager
from the replica's synchronous loop) runs against `StandInTokenizerManager`,
async methods with the 0.5.23 signatures; only SGLang's message constructors
are replaced by plain records there.

Real SGLang objects: the `real_sglang` tests build `GenerateReqInput`,
`UpdateWeightsFromTensorReqInput`, `SamplingParams` and the adaptive
speculative parameters from what the adapter produces. They are skipped where
`sglang.srt.managers.io_struct` cannot be imported (this CPU machine: the
0.5.23 wheel downloads, but importing io_struct needs torchvision built for
the installed torch and CUDA-only packages).
"""

from __future__ import annotations

import json

import pytest
import torch

from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.engine import SGLangEngine
from tlt.services.rollout.sglang_backend.launch import adaptive_spec_config, engine_kwargs, write_adaptive_config
from tlt.services.rollout.sglang_backend.requests import (
    StreamChunk,
    generate_calls,
    parse_chunk,
    sglang_sampling,
    tensor_update_call,
)
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams


def sglang_chunk(rid, ids, lps=None, finish=None, text=None, **meta):
    """A chunk as TokenizerManager._handle_batch_output yields it (non-incremental stream)."""
    meta_info = {"id": rid, "finish_reason": finish, "prompt_tokens": 3, "weight_version": "0", **meta}
    if lps is not None:
        meta_info["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps, ids)]
    return {"text": text, "output_ids": list(ids), "meta_info": meta_info}


class FakeSGLang:
    """Records calls; `poll` hands out the chunks queued with `feed`."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.pending: list[StreamChunk] = []
        self.submitted = {}

    def feed(self, *chunks):
        self.pending.extend(parse_chunk(c) for c in chunks)

    def submit(self, call):
        self.submitted[call.rid] = call
        self.calls.append(("submit", call.rid))

    def poll(self, timeout_s):
        out, self.pending = self.pending, []
        return out

    def abort(self, rid):
        self.calls.append(("abort", rid))
        self.feed(sglang_chunk(rid, [], finish={"type": "abort", "message": "aborted by user"}))

    def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.calls.append(("continue",))

    def begin_weight_update(self, selector):
        self.calls.append(("begin", selector))

    def update_weights_from_tensor(self, call, tensors):
        self.calls.append(("update", call.selector, call.flush_cache, call.weight_version, tuple(n for n, _ in tensors)))

    def end_weight_update(self):
        self.calls.append(("end",))

    def flush_cache(self):
        self.calls.append(("flush",))

    def release_memory_occupation(self, tags):
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags):
        self.calls.append(("resume", tuple(tags)))

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 64, "hidden_size": 8, "max_position_embeddings": 128, "eos_token_id": 2}))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(64, 8, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def make_engine(model_dir, **cfg):
    fake = FakeSGLang()
    config = SGLangBackendConfig(draft_model_path="/drafter", **cfg)
    return SGLangEngine(model_dir, config, replica_id=1, client=fake), fake


# -- launch arguments ----------------------------------------------------------------


def test_threshold_becomes_a_no_draft_slot():
    cfg = SGLangBackendConfig(spec_batch_threshold=8, adaptive_steps={"1": [1, 3, 5], "5": [1, 3], "21": [0, 1]})
    slots = adaptive_spec_config(cfg)
    # keys above the threshold are dropped; threshold + 1 drafts nothing
    assert slots == {"1": {"candidate_steps": [1, 3, 5]}, "5": {"candidate_steps": [1, 3]}, "9": {"candidate_steps": [0]}}


def test_engine_kwargs_adaptive_and_static(tmp_path):
    cfg = SGLangBackendConfig(draft_model_path="/d", num_steps=3)
    path = write_adaptive_config(cfg, tmp_path)
    kw = engine_kwargs(cfg, "/m", replica_id=2, adaptive_config_path=str(path))
    assert kw["speculative_algorithm"] == "EAGLE" and kw["speculative_adaptive"] is True
    assert kw["speculative_adaptive_config"] == str(path) and json.loads(path.read_text())["33"] == {"candidate_steps": [0]}
    assert "speculative_num_draft_tokens" not in kw  # SGLang derives steps + 1 in adaptive mode
    assert kw["base_gpu_id"] == 2 and kw["enable_return_hidden_states"] is True
    static = SGLangBackendConfig(draft_model_path="/d", adaptive=False, num_steps=8, eagle_topk=4, num_draft_tokens=48)
    kw = engine_kwargs(static, "/m", 0)
    assert (kw["speculative_num_steps"], kw["speculative_eagle_topk"], kw["speculative_num_draft_tokens"]) == (8, 4, 48)
    assert "speculative_adaptive" not in kw


def test_config_refuses_what_sglang_refuses():
    with pytest.raises(ValueError, match="eagle_topk = 1"):
        SGLangBackendConfig(eagle_topk=4)  # adaptive needs a chain
    with pytest.raises(ValueError, match="candidate steps"):
        SGLangBackendConfig(num_steps=4)
    with pytest.raises(ValueError, match="packed auxiliary"):
        SGLangBackendConfig(speculative_algorithm="EAGLE3")
    assert SGLangBackendConfig(speculative_algorithm="EAGLE3", return_hidden_states=False).speculative_algorithm == "EAGLE3"
    with pytest.raises(ValueError, match="needs a drafter"):
        engine_kwargs(SGLangBackendConfig(adaptive=False), "/m", 0)
    assert "speculative_algorithm" not in engine_kwargs(SGLangBackendConfig(speculative_algorithm="none"), "/m", 0)


# -- requests and chunks ----------------------------------------------------------------


def test_sampling_mapping_and_per_sample_seeds():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=10, max_tokens=5, stop=("\n\n",), stop_token_ids=(7, 7))
    s = sglang_sampling(p, sample_index=3, default_max_tokens=100)
    assert s == {"temperature": 0.7, "top_p": 0.9, "min_p": 0.0, "max_new_tokens": 5, "ignore_eos": False,
                 "skip_special_tokens": True, "stop": ["\n\n"], "stop_token_ids": [7], "sampling_seed": 13}
    assert "top_k" not in s  # TLT's "no top-k" is SGLang's default
    calls = generate_calls(GenerationRequest("r", (1, 2, 3), SamplingParams(logprobs=2), n=2), 50, True)
    assert [c.rid for c in calls] == ["r#0", "r#1"]
    assert calls[0].return_logprob and calls[0].top_logprobs_num == 2 and calls[0].sampling_dict()["max_new_tokens"] == 50
    with pytest.raises(ValueError, match="must not contain"):
        generate_calls(GenerationRequest("a#b", (1,)), 10, True)


def test_parse_chunk_reads_sglang_layout():
    c = parse_chunk(sglang_chunk("r#1", [5, 6], [-0.5, -1.0], {"type": "length", "length": 2}, "hi",
                                 spec_verify_ct=1, completion_tokens=2,
                                 output_top_logprobs=[[(-0.5, 5, None), (-2.0, 9, None)], [(-1.0, 6, None)]]))
    assert (c.rid, c.output_ids, c.logprobs, c.finish, c.text) == ("r#1", [5, 6], [-0.5, -1.0], FinishReason.LENGTH, "hi")
    assert c.top_logprobs == [{5: -0.5, 9: -2.0}, {6: -1.0}] and c.spec_verify_ct == 1
    assert parse_chunk(sglang_chunk("x#0", [1])).finish is None


def test_tlt_drafter_names_become_sglang_eagle_names():
    from tlt.services.rollout.sglang_backend.requests import sglang_drafter_tensors

    out = sglang_drafter_tensors({"fc.weight": torch.ones(4, 8), "layer.self_attn.q_proj.weight": torch.ones(4, 4),
                                  "layer.post_attention_layernorm.weight": torch.ones(4)})
    assert sorted(out) == ["fc.bias", "fc.weight", "layers.0.post_attention_layernorm.weight",
                           "layers.0.self_attn.q_proj.weight"]
    assert out["fc.bias"].shape == (4,) and not out["fc.bias"].any()  # TLT's fc has no bias: SGLang's must be 0
    same = {"fc.weight": torch.ones(2, 4), "fc.bias": torch.ones(2), "layers.0.mlp.up_proj.weight": torch.ones(3, 2)}
    assert sglang_drafter_tensors(same) == same


def test_drafter_update_never_carries_shared_weights():
    assert tensor_update_call("policy", ["model.embed_tokens.weight"], 3).selector == "target"
    assert tensor_update_call("drafter", ["fc.weight", "layers.0.mlp.up_proj.weight"], 2).selector == "draft"
    for shared in ("model.embed_tokens.weight", "lm_head.weight"):
        with pytest.raises(ValueError, match="shared"):
            tensor_update_call("drafter", ["fc.weight", shared], 2)
    with pytest.raises(ValueError, match="unknown weight kind"):
        tensor_update_call("both", [], 1)


# -- the adapter against the fake engine ------------------------------------------------------


def test_streams_become_steps_and_completions(model_dir):
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1, 2, 3), SamplingParams(logprobs=0), n=2))
    assert eng.has_unfinished() and eng.stats().running == 2 and fake.calls == [("submit", "r#0"), ("submit", "r#1")]
    fake.feed(sglang_chunk("r#0", [4], [-0.1]), sglang_chunk("r#1", [7], [-0.3]))
    steps, done = eng.step()
    assert [(s.sample_index, s.new_token_ids, s.new_logprobs) for s in steps] == [(0, [4], [-0.1]), (1, [7], [-0.3])]
    assert done == []
    fake.feed(sglang_chunk("r#0", [4, 5, 2], [-0.1, -0.2, -0.05], {"type": "stop", "matched": 2}, "ab",
                           spec_verify_ct=2, completion_tokens=3))
    steps, done = eng.step()
    assert steps[0].new_token_ids == [5, 2] and steps[0].new_logprobs == [-0.2, -0.05] and steps[0].finished
    (c,) = done
    assert (c.request_id, c.sample_index, c.token_ids, c.text, c.finish_reason) == ("r", 0, [4, 5, 2], "ab", FinishReason.STOP)
    assert c.prompt_token_ids == [1, 2, 3] and c.replica_id == 1 and c.versions.policy == 0 and c.versions.drafter == 0
    assert (c.spec.verify_steps, c.spec.accepted_tokens) == (2, 3)
    assert eng.stats().running == 1 and eng.stats().spec["mean_accept_len"] == 1.5


def test_abort_reports_an_aborted_completion(model_dir):
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1,), n=1))
    eng.abort_request("r")
    _, (c,) = eng.step()
    assert c.finish_reason is FinishReason.ABORT and "aborted" in c.error and not eng.has_unfinished()
    with pytest.raises(ValueError, match="does not fit"):
        eng.add_request(GenerationRequest("long", tuple(range(200))))


def test_policy_update_session_order(model_dir):
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1,)))
    fake.calls.clear()
    eng.update_weights("policy", {"model.embed_tokens.weight": torch.ones(64, 8)}, version=1)
    assert fake.calls == [("pause", "retract"), ("begin", "target"),
                          ("update", "target", False, "1", ("model.embed_tokens.weight",)),
                          ("end",), ("flush",), ("continue",)]
    assert eng.versions.policy == 1
    fake.feed(sglang_chunk("r#0", [3], finish={"type": "stop"}))
    _, (c,) = eng.step()
    assert (c.versions.policy, c.versions.policy_min) == (1, 0)  # mixed: newest and oldest, as the native engine
    assert eng.stats().spec["policy_spanning"] == 1
    eng.add_request(GenerationRequest("s", (1,)))
    fake.feed(sglang_chunk("s#0", [3], finish={"type": "stop"}))
    _, (c,) = eng.step()
    assert (c.versions.policy, c.versions.policy_min) == (1, None)
    with pytest.raises(ValueError, match="not newer"):
        eng.update_weights("policy", {}, version=1)


def test_drafter_update_pauses_in_place_without_flush(model_dir):
    eng, fake = make_engine(model_dir)
    eng.update_weights("drafter", {"fc.weight": torch.ones(8, 16)}, version=4)
    assert fake.calls == [("pause", "in_place"), ("begin", "draft"),
                          ("update", "draft", False, "4", ("fc.weight", "fc.bias")), ("end",), ("continue",)]
    assert eng.versions.drafter == 4 and eng.versions.policy == 0


def test_failed_update_still_closes_the_session_and_continues(model_dir):
    eng, fake = make_engine(model_dir)

    def refuse(call, tensors):
        fake.calls.append(("update-refused",))
        raise RuntimeError("SGLang update_weights_from_tensor(target) failed: shape mismatch")

    fake.update_weights_from_tensor = refuse
    with pytest.raises(RuntimeError, match="shape mismatch"):
        eng.update_weights("policy", {"model.embed_tokens.weight": torch.ones(64, 8)}, version=1)
    assert fake.calls[-2:] == [("end",), ("continue",)] and eng.versions.policy == 0


def test_bad_push_is_rejected_before_sglang_sees_it(model_dir):
    eng, fake = make_engine(model_dir)
    for bad in ({"model.embed_tokens.weight": torch.ones(64, 9)}, {"model.nope.weight": torch.ones(1)}, {}):
        with pytest.raises(ValueError, match="rejected|no tensors"):
            eng.update_weights("policy", bad, version=1)
    assert fake.calls == [] and eng.versions.policy == 0
    eng.update_weights("policy", {"lm_head.weight": torch.ones(64, 8)}, version=1)  # tied to embed_tokens
    assert eng.versions.policy == 1


def test_resume_repushes_the_drafter(model_dir):
    eng, fake = make_engine(model_dir, release_tags=["kv_cache", "weights"])
    eng.update_weights("drafter", {"fc.weight": torch.full((2, 2), 3.0)}, version=2)
    fake.calls.clear()
    eng.release()
    with pytest.raises(ValueError, match="released"):
        eng.add_request(GenerationRequest("r", (1,)))
    eng.resume()
    assert fake.calls == [("release", ("kv_cache", "weights")), ("resume", ("kv_cache", "weights")),
                          ("pause", "in_place"), ("begin", "draft"),
                          ("update", "draft", False, "2", ("fc.weight", "fc.bias")), ("end",), ("continue",)]
    assert eng.stats().spec["drafter_repushes"] == 1
    eng.add_request(GenerationRequest("r", (1,)))
    with pytest.raises(ValueError, match="cannot release"):
        eng.release()


def test_kv_only_release_does_not_repush(model_dir):
    eng, fake = make_engine(model_dir)
    eng.update_weights("drafter", {"fc.weight": torch.ones(1)}, version=1)
    fake.calls.clear()
    eng.release()
    eng.resume()
    assert fake.calls == [("release", ("kv_cache",)), ("resume", ("kv_cache",))]


def test_features_and_expected_weights(model_dir):
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1, 2, 3), SamplingParams(return_features=True)))
    assert fake.submitted["r#0"].return_hidden_states
    hidden = [[[0.0] * 8] * 3, [1.0] * 8, [2.0] * 8]  # prompt block, then one row per token
    fake.feed(sglang_chunk("r#0", [4, 5], finish={"type": "length"}, hidden_states=hidden))
    _, (c,) = eng.step()
    assert c.features.dtype == torch.float16 and c.features.shape == (2, 8) and c.features[1, 0] == 2.0
    assert eng.expected_weights() == {"model.embed_tokens.weight": ((64, 8), "bfloat16")}


# -- real SGLang objects (GPU images with the extra installed) ----------------------------------


@pytest.fixture()
def io_struct():
    return pytest.importorskip(
        "sglang.srt.managers.io_struct",
        reason="sglang (the optional `sglang` extra, GPU only) is not importable here",
    )


def test_real_generate_req_input(io_struct):
    from tlt.services.rollout.sglang_backend.client import to_generate_req_input
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLSamplingParams

    (call,) = generate_calls(GenerationRequest("r", (1, 2), SamplingParams(temperature=0.5, seed=3, logprobs=1)), 16, True)
    obj = to_generate_req_input(call)
    assert isinstance(obj, io_struct.GenerateReqInput)
    assert (obj.rid, obj.input_ids, obj.stream, obj.return_logprob, obj.top_logprobs_num) == ("r#0", [1, 2], True, True, 1)
    sp = SGLSamplingParams(**obj.sampling_params)
    assert sp.temperature == 0.5 and sp.max_new_tokens == 16 and sp.sampling_seed == 3


def test_real_update_req_input(io_struct):
    from tlt.services.rollout.sglang_backend.client import to_update_req_input

    obj = to_update_req_input(tensor_update_call("drafter", ["fc.weight"], 7), [b"x"])
    assert isinstance(obj, io_struct.UpdateWeightsFromTensorReqInput)
    assert (obj.selector, obj.flush_cache, obj.weight_version, obj.serialized_named_tensors) == ("draft", False, "7", [b"x"])
    assert io_struct.BeginWeightUpdateReqInput(selector="target").selector == "target"
    assert io_struct.PauseGenerationReqInput(mode="retract").mode == "retract"


def test_real_adaptive_params_follow_the_threshold(io_struct, tmp_path):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    cfg = SGLangBackendConfig(spec_batch_threshold=16)
    params = AdaptiveSpeculativeParams(initial_steps=cfg.num_steps, cfg_path=str(write_adaptive_config(cfg, tmp_path)))
    assert params.get_steps_for_batch(17) == 0 and params.get_steps_for_batch(64) == 0
    assert params.get_steps_for_batch(1) == cfg.num_steps


def test_replica_config_comes_from_the_preset_and_environment(model_dir, monkeypatch, tmp_path):
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.sglang_backend.engine import resolve_config

    preset = tmp_path / "p.toml"
    preset.write_text('[sglang]\nmem_fraction_static = 0.5\nspeculative_algorithm = "EAGLE3"\nreturn_hidden_states = false\n')
    monkeypatch.setenv("TLT_PRESET", str(preset))
    monkeypatch.setenv("TLT_SGLANG__DRAFT_MODEL_PATH", "/models/drafter")
    cfg = resolve_config(EngineConfig())  # what the replica process passes every backend
    assert (cfg.mem_fraction_static, cfg.speculative_algorithm, cfg.draft_model_path) == (0.5, "EAGLE3", "/models/drafter")
    eng = SGLangEngine(model_dir, EngineConfig(), client=FakeSGLang())
    assert eng.config.draft_model_path == "/models/drafter"


# -- the real EngineClient's asyncio pump, over a stand-in TokenizerManager --------------------


class StandInTokenizerManager:
    """Async methods with SGLang 0.5.23's TokenizerManager signatures; streams scripted chunks."""

    def __init__(self, scripts):
        self.scripts = scripts  # rid -> list of (delay_s, chunk dict) or an exception to raise
        self.log = []
        self.aborted = set()

    async def generate_request(self, obj, request=None):
        import asyncio

        script = self.scripts[obj.rid]
        if isinstance(script, Exception):
            raise script
        for delay, chunk in script:
            await asyncio.sleep(delay)
            if obj.rid in self.aborted:
                yield sglang_chunk(obj.rid, chunk["output_ids"], finish={"type": "abort", "message": "aborted"})
                return
            yield chunk

    def abort_request(self, rid="", abort_all=False):
        self.aborted.add(rid)

    async def pause_generation(self, obj):
        self.log.append(("pause", obj.mode))

    async def continue_generation(self, obj):
        self.log.append(("continue",))

    async def begin_weight_update(self, obj, request=None):
        self.log.append(("begin", obj.selector))
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request=None):
        self.log.append(("update", obj.selector, obj.flush_cache, len(obj.serialized_named_tensors)))
        return False, "shape mismatch for fc.weight"

    async def end_weight_update(self, obj, request=None):
        self.log.append(("end",))
        return True, "Success"

    async def flush_cache(self, timeout_s=None):
        from types import SimpleNamespace

        return SimpleNamespace(success=False, message="pending requests")


class StandInEngine:
    def __init__(self, tm):
        import asyncio

        self.tokenizer_manager = tm
        self.loop = asyncio.new_event_loop()

    def shutdown(self):
        self.loop.close()


@pytest.fixture()
def stand_in(monkeypatch):
    """EngineClient with SGLang's message constructors replaced by pass-throughs (no sglang here)."""
    import sys
    from types import SimpleNamespace

    from tlt.services.rollout.sglang_backend import client as client_mod

    monkeypatch.setattr(client_mod, "to_generate_req_input", lambda call: call)
    monkeypatch.setattr(client_mod, "to_update_req_input",
                        lambda call, ser: SimpleNamespace(selector=call.selector, flush_cache=call.flush_cache,
                                                          serialized_named_tensors=ser))
    monkeypatch.setattr(client_mod, "serialize_per_rank", lambda tensors, tp: [b"rank"] * tp)

    def message(**kw):
        return SimpleNamespace(**kw)

    # The io_struct classes the control calls build, as plain records.
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", SimpleNamespace(
        PauseGenerationReqInput=message, ContinueGenerationReqInput=message,
        BeginWeightUpdateReqInput=message, EndWeightUpdateReqInput=message))
    made = []

    def make(scripts):
        tm = StandInTokenizerManager(scripts)
        eng = StandInEngine(tm)
        made.append(eng)
        return client_mod.EngineClient(eng, tp_size=2), tm

    yield make
    for eng in made:
        eng.shutdown()


def test_engine_client_pumps_streams_and_reports_failures(stand_in):
    calls = [generate_calls(GenerationRequest(r, (1,)), 8, True)[0] for r in ("a", "b", "c")]
    scripts = {
        "a#0": [(0.0, sglang_chunk("a#0", [5])), (0.01, sglang_chunk("a#0", [5, 6], finish={"type": "stop"}))],
        "b#0": ValueError("prompt too long for SGLang"),
        "c#0": [(0.0, sglang_chunk("c#0", [9])), (0.3, sglang_chunk("c#0", [9, 9], finish={"type": "stop"}))],
    }
    client, tm = stand_in(scripts)
    for call in calls:
        client.submit(call)
    seen = []

    def pump_until(done):
        for _ in range(100):
            seen.extend(client.poll(0.05))
            if done():
                return
        raise AssertionError(f"never happened; saw {[(c.rid, c.output_ids, c.finish) for c in seen]}")

    pump_until(lambda: any(c.rid == "a#0" and c.finish for c in seen) and any(c.rid == "b#0" for c in seen))
    assert [c.output_ids for c in seen if c.rid == "a#0"] == [[5], [5, 6]]
    assert [c.finish for c in seen if c.rid == "a#0"][-1] is FinishReason.STOP
    (b,) = [c for c in seen if c.rid == "b#0"]
    assert b.finish is FinishReason.ABORT and "too long" in b.error  # a rejected request ends, it does not hang
    client.abort("c#0")
    pump_until(lambda: any(c.rid == "c#0" and c.finish for c in seen))
    assert [c.finish for c in seen if c.rid == "c#0"][-1] is FinishReason.ABORT
    assert client.poll(0.0) == []  # nothing left over


def test_engine_client_control_calls_raise_sglang_refusals(stand_in):
    from tlt.services.rollout.sglang_backend.client import SGLangError

    client, tm = stand_in({})
    client.pause_generation("in_place")
    client.begin_weight_update("draft")
    with pytest.raises(SGLangError, match="shape mismatch"):
        client.update_weights_from_tensor(tensor_update_call("drafter", ["fc.weight"], 1), [("fc.weight", torch.ones(1))])
    client.end_weight_update()
    client.continue_generation()
    with pytest.raises(SGLangError, match="flush_cache failed"):
        client.flush_cache()
    assert tm.log == [("pause", "in_place"), ("begin", "draft"), ("update", "draft", False, 2), ("end",), ("continue",)]


def test_without_sglang_the_backend_says_how_to_get_it(model_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(ModuleNotFoundError, match=r"tlt\[sglang\]"):
        SGLangEngine(model_dir, SGLangBackendConfig(draft_model_path="/drafter"), run_dir=str(tmp_path))
    assert (tmp_path / "sglang-adaptive-spec.json").exists()  # written before SGLang would start
