"""What the SGLang backend sends to SGLang: launch arguments, requests, chunk parsing, config rules.

Pure mappings from TLT's types to SGLang 0.5.23's (`ServerArgs` keywords, the adaptive
speculative JSON, `GenerateReqInput` / `SamplingParams` fields, `UpdateWeightsFromTensorReqInput`
selectors, EAGLE draft tensor names), checked against hand-written expectations.

Real SGLang objects: the `io_struct` tests build `GenerateReqInput`,
`UpdateWeightsFromTensorReqInput`, `SamplingParams` and the adaptive speculative
parameters from what the adapter produces. They are skipped where
`sglang.srt.managers.io_struct` cannot be imported (this CPU machine: the 0.5.23
wheel downloads, but importing io_struct needs torchvision built for the installed
torch and CUDA-only packages). The adapter's behaviour against a fake engine is in
tests/test_sglang_adapter.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_fakes import sglang_chunk
from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.launch import adaptive_spec_config, engine_kwargs, write_adaptive_config
from tlt.services.rollout.sglang_backend.requests import (
    generate_calls,
    parse_chunk,
    sglang_sampling,
    tensor_update_call,
)
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams


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


def test_per_request_seeds_need_sglangs_deterministic_mode():
    """SGLang keeps a request's sampling_seed only with enable_deterministic_inference (its sampling_batch_info and
    sampler read it only then): seeds were sent and silently dropped. The option sets it; without it the engine
    says so once (test_sglang_adapter)."""
    assert "enable_deterministic_inference" not in engine_kwargs(SGLangBackendConfig(speculative_algorithm="none"), "/m", 0)
    kw = engine_kwargs(SGLangBackendConfig(speculative_algorithm="none", deterministic_inference=True), "/m", 0)
    assert kw["enable_deterministic_inference"] is True


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


def test_reserved_draft_slots_follow_sglang_formula():
    from tlt.services.rollout.sglang_backend.launch import reserved_tokens

    # compute_num_reserved_tokens: max(topk * steps, max draft tokens)
    assert reserved_tokens(SGLangBackendConfig(speculative_algorithm="none")) == 0
    assert reserved_tokens(SGLangBackendConfig(adaptive=False, num_steps=3)) == 4
    assert reserved_tokens(SGLangBackendConfig(adaptive=False, num_steps=8, eagle_topk=4, num_draft_tokens=48)) == 48
    # adaptive: max(candidate_steps) + 1 over the slots actually written (threshold drops "21")
    cfg = SGLangBackendConfig(spec_batch_threshold=8, adaptive_steps={"1": [1, 3], "21": [0, 9]}, num_steps=3)
    assert reserved_tokens(cfg) == 4


def test_draft_weights_backed_up_when_weights_can_be_released(tmp_path):
    path = str(write_adaptive_config(SGLangBackendConfig(), tmp_path))
    kw = engine_kwargs(SGLangBackendConfig(draft_model_path="/d", enable_memory_saver=True,
                                           release_tags=["kv_cache", "weights"]), "/m", 0, path)
    assert kw["enable_memory_saver"] is True and kw["enable_draft_weights_cpu_backup"] is True
    kw = engine_kwargs(SGLangBackendConfig(draft_model_path="/d", enable_memory_saver=True), "/m", 0, path)
    assert "enable_draft_weights_cpu_backup" not in kw  # only the KV cache is released


# -- requests and chunks ----------------------------------------------------------------


def test_sampling_mapping_and_per_sample_seeds():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, seed=10, max_tokens=5, stop=("\n\n",), stop_token_ids=(7, 7))
    s = sglang_sampling(p, sample_index=3, default_max_tokens=100)
    assert s == {"temperature": 0.7, "top_p": 0.9, "min_p": 0.0, "max_new_tokens": 5, "ignore_eos": False,
                 "skip_special_tokens": True, "stop": ["\n\n"], "stop_token_ids": [7],
                 "sampling_seed": 10 * 1_000_003 + 3 * 7919 + 1}  # the native engine's key of sample 3 (seed_for)
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


def test_sampling_keeps_top_k_1_and_ignore_eos_and_an_unknown_finish_is_an_abort():
    # top_k = 1 is greedy by top-k (a real filter, unlike TLT's 0); ignore_eos must reach SGLang or its samples stop
    # at EOS where the native engine's run to max_tokens
    s = sglang_sampling(SamplingParams(top_k=1, ignore_eos=True), sample_index=0, default_max_tokens=16)
    assert s["top_k"] == 1 and s["ignore_eos"] is True
    assert sglang_sampling(SamplingParams(top_k=2), 0, 16)["top_k"] == 2
    # a finish type the adapter does not know ends the sample as aborted, with SGLang's message, never as a stop
    c = parse_chunk(sglang_chunk("r#0", [5], None, {"type": "preempted", "message": "evicted"}))
    assert (c.finish, c.error) == (FinishReason.ABORT, "evicted")
    assert parse_chunk(sglang_chunk("r#0", [5], None, {"type": "stop", "matched": 2})).finish is FinishReason.STOP


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
    assert (obj.selector, obj.flush_cache, obj.weight_version, obj.serialized_named_tensors) == ("draft", False, None, [b"x"])
    assert io_struct.BeginWeightUpdateReqInput(selector="target").selector == "target"
    assert io_struct.PauseGenerationReqInput(mode="retract").mode == "retract"


def test_real_adaptive_params_follow_the_threshold(io_struct, tmp_path):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    cfg = SGLangBackendConfig(spec_batch_threshold=16)
    params = AdaptiveSpeculativeParams(initial_steps=cfg.num_steps, cfg_path=str(write_adaptive_config(cfg, tmp_path)))
    assert params.get_steps_for_batch(17) == 0 and params.get_steps_for_batch(64) == 0
    assert params.get_steps_for_batch(1) == cfg.num_steps


def test_real_server_args_take_every_launch_argument(io_struct, tmp_path):
    from sglang.srt.server_args import ServerArgs

    cfg = SGLangBackendConfig(draft_model_path=str(tmp_path))
    kw = engine_kwargs(cfg, str(tmp_path), 1, str(write_adaptive_config(cfg, tmp_path)))
    args = ServerArgs(**kw)  # construction only; SGLang resolves (and needs the GPU) at launch
    for name, value in kw.items():
        assert getattr(args, name) == value
