"""The SGLang backend adapter's behaviour: streams, completions, weight sessions, release / resume.

Faked here: SGLang's engine (it needs a CUDA GPU and is an optional extra that is never
installed by default). `FakeSGLang` (tests/sglang_fakes.py) stands in for the `SGLangClient`
boundary only: it records every call in order and replays stream chunks laid out exactly as
SGLang 0.5.23's TokenizerManager yields them. Everything above that boundary (request
building, stream slicing, completions, version stamping, weight-update sessions, validation,
release / resume with the drafter re-push, stats) is the real adapter.

The real `EngineClient` (the asyncio pump that drives SGLang's TokenizerManager from the
replica's synchronous loop) runs against `StandInTokenizerManager`, async methods with the
0.5.23 signatures; only SGLang's message constructors are replaced by plain records there.
"""

from __future__ import annotations

import pytest
import torch

from sglang_fakes import FakeSGLang, make_engine, sglang_chunk, write_checkpoint
from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
from tlt.services.rollout.sglang_backend.engine import SGLangEngine
from tlt.services.rollout.sglang_backend.requests import generate_calls, tensor_update_call
from tlt.services.rollout.types import FinishReason, GenerationRequest, SamplingParams


@pytest.fixture()
def model_dir(tmp_path):
    return write_checkpoint(tmp_path)


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


def test_a_redispatched_subset_of_samples_keeps_each_samples_index_and_seed(model_dir):
    """The replica pool re-issues only the samples a dead replica had not finished (`sample_indices`,
    services/rollout/replicas.py); SGLang ran samples 0..len-1 instead: samples 0 and 1 again (duplicates of
    finished ones, with their seeds) in place of 1 and 3, so the pool refused to re-dispatch a partly finished
    request to an SGLang replica."""
    eng, fake = make_engine(model_dir)
    assert eng.runs_sample_subsets
    params = SamplingParams(temperature=1.0, seed=7)
    whole = {c.rid: c for c in generate_calls(GenerationRequest("w", (1, 2, 3), params, n=4), 64, False)}
    eng.add_request(GenerationRequest("r", (1, 2, 3), params, n=4, sample_indices=(1, 3)))
    assert [c for c in fake.calls if c[0] == "submit"] == [("submit", "r#1"), ("submit", "r#3")]
    for i in (1, 3):  # the same per-sample seed as in the whole request
        assert dict(fake.submitted[f"r#{i}"].sampling_params)["sampling_seed"] == \
            dict(whole[f"w#{i}"].sampling_params)["sampling_seed"]
    fake.feed(sglang_chunk("r#3", [4, 2], [-0.1, -0.2], {"type": "stop", "matched": 2}, "a"))
    steps, (c,) = eng.step()
    assert steps[0].sample_index == 3 and c.sample_index == 3
    with pytest.raises(ValueError, match="sample_indices"):
        eng.add_request(GenerationRequest("bad", (1,), n=2, sample_indices=(2,)))


def test_a_seed_sglang_would_drop_is_named_once(model_dir, capsys):
    """SGLang applies sampling_seed only in its deterministic-inference mode; without [sglang]
    deterministic_inference the seed is still sent (harmless) and the replica says, once, that it is not applied."""
    eng, _ = make_engine(model_dir)
    for i in range(3):
        eng.add_request(GenerationRequest(f"s{i}", (1, 2, 3), SamplingParams(temperature=1.0, seed=i)))
    out = capsys.readouterr()
    assert (out.out + out.err).count("sglang_seed_ignored") == 1 and eng._seed_warned
    quiet, _ = make_engine(model_dir, deterministic_inference=True)
    quiet.add_request(GenerationRequest("s", (1, 2, 3), SamplingParams(temperature=1.0, seed=1)))
    assert not quiet._seed_warned


def test_abort_reports_an_aborted_completion(model_dir):
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1,), n=1))
    eng.abort_request("r")
    _, (c,) = eng.step()
    assert c.finish_reason is FinishReason.ABORT and "aborted" in c.error and not eng.has_unfinished()
    with pytest.raises(ValueError, match="does not fit"):
        eng.add_request(GenerationRequest("long", tuple(range(200))))


def test_an_aborted_sample_keeps_the_tokens_it_streamed(model_dir):
    """SGLang's abort answer for a streamed request repeats only the last id (TokenizerManager._handle_abort_req),
    with the logprobs of all of them: the result must still be every token streamed, paired with its logprob."""
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=20, logprobs=0)))
    fake.feed(sglang_chunk("r#0", [10, 11], lps=[-0.1, -0.2]))
    fake.feed(sglang_chunk("r#0", [10, 11, 12, 13], lps=[-0.1, -0.2, -0.3, -0.4]))
    steps, _ = eng.step()
    streamed = [t for s in steps for t in s.new_token_ids]
    eng.abort_request("r")
    steps, (c,) = eng.step()
    assert [t for s in steps for t in s.new_token_ids] == [] and steps[-1].finished
    assert streamed == [10, 11, 12, 13] and c.token_ids == streamed
    assert c.finish_reason is FinishReason.ABORT and c.logprobs == [-0.1, -0.2, -0.3, -0.4]


def test_an_abort_answer_ahead_of_what_was_streamed_is_read_from_its_logprobs_or_not_at_all(model_dir):
    """SGLang yields only a request's newest output to a consumer that fell behind: the short abort answer (the last
    id, completion_tokens N, all N logprob entries and the whole text) can come with fewer than N tokens streamed.
    Its one id was taken for the next token, paired with the first token's logprob, and its text replaced the
    streamed one: ids, logprobs and text no longer agreed."""
    abort = {"type": "abort", "message": "Abort in waiting queue"}
    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=20, logprobs=0)))
    answer = sglang_chunk("r#0", [13], finish=abort, text="abcd", completion_tokens=4)
    answer["meta_info"]["output_token_logprobs"] = [(-0.1, 10, None), (-0.2, 11, None), (-0.3, 12, None), (-0.4, 13, None)]
    fake.feed(answer)  # nothing streamed before it: the ids are in the logprob entries
    _, (c,) = eng.step()
    assert c.token_ids == [10, 11, 12, 13] and c.logprobs == [-0.1, -0.2, -0.3, -0.4] and c.text == "abcd"

    eng, fake = make_engine(model_dir)
    eng.add_request(GenerationRequest("q", (1, 2, 3), SamplingParams(max_tokens=20)))
    fake.feed(sglang_chunk("q#0", [10], text="a"))
    fake.feed(sglang_chunk("q#0", [13], finish=abort, text="abcd", completion_tokens=4))  # no logprobs asked
    _, (c,) = eng.step()
    assert c.token_ids == [10] and c.text == "a"  # what was streamed, consistent; not [10] with "abcd"


def test_the_replica_answers_an_abort_only_once_sglang_has_ended_the_samples(model_dir):
    """SGLang ends an aborted sample asynchronously (its final chunk comes with a later poll), so the replica loop
    (real ReplicaLoop over a real pipe) answers the abort, after which the front counts the work out and may
    publish IDLE, only after the step that reports those ends, with the load that follows (nothing running)."""
    import multiprocessing as mp
    import threading

    from tlt.services.rollout.ipc import Aborted, AbortRequest, AddRequest, EngineLoad, Shutdown, StepEvents
    from tlt.services.rollout.replica import ReplicaLoop

    eng, fake = make_engine(model_dir)
    front, back = mp.Pipe()
    runner = threading.Thread(target=ReplicaLoop(eng, back, 1).run, daemon=True)
    runner.start()
    try:
        front.send(AddRequest(GenerationRequest("r", (1, 2, 3), n=2)))
        front.send(AbortRequest("r", 7))
        got = []
        while not any(isinstance(ev, Aborted) for ev in got):
            assert front.poll(10)
            got.append(front.recv())
    finally:
        front.send(Shutdown())
        runner.join(10)
    assert [type(ev) for ev in got] == [StepEvents, Aborted]
    assert [(c.request_id, c.finish_reason) for c in got[0].finished] == [("r", FinishReason.ABORT)] * 2
    assert got[1] == Aborted(7, EngineLoad(0, 0, 0.0)) and not eng.holds("r")


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
    eng.add_request(GenerationRequest("t", (1,), n=2))  # each sample running through an update counts, not the update
    eng.update_weights("policy", {"model.embed_tokens.weight": torch.ones(64, 8)}, version=2)
    assert eng.stats().spec["policy_spanning"] == 3


def test_drafter_update_pauses_in_place_without_flush(model_dir):
    eng, fake = make_engine(model_dir)
    eng.update_weights("drafter", {"fc.weight": torch.ones(8, 16)}, version=4)
    assert fake.calls == [("pause", "in_place"), ("begin", "draft"),
                          ("update", "draft", False, None, ("fc.weight", "fc.bias")), ("end",), ("continue",)]
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
                          ("update", "draft", False, None, ("fc.weight", "fc.bias")), ("end",), ("continue",)]
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


def test_expected_weights_read_the_files_transformers_reads(model_dir):
    """A folder with model.safetensors beside a stale index and its shards (a re-save over an old sharded
    checkpoint): the policy is model.safetensors, as transformers (the trainer) and the native engine read it
    (tlt/model/folder.py weight_files). Globbing every *.safetensors mixed the stale shard's tensors in, so a
    push of the real names and shapes was refused (or a stale name accepted)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(model_dir)
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8, dtype=torch.bfloat16),
               "model.stale.weight": torch.zeros(2, dtype=torch.bfloat16)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors",
                        "model.stale.weight": "model-00001-of-00001.safetensors"}}))
    eng, fake = make_engine(model_dir)
    assert eng.expected_weights() == {"model.embed_tokens.weight": ((64, 8), "bfloat16")}
    eng.update_weights("policy", {"model.embed_tokens.weight": torch.ones(64, 8)}, version=1)
    with pytest.raises(ValueError, match="unknown tensor 'model.stale.weight'"):
        eng.update_weights("policy", {"model.stale.weight": torch.ones(2)}, version=2)
    (folder / "model.safetensors").unlink()  # the shards alone: the index's files
    eng2, _ = make_engine(model_dir)
    assert set(eng2.expected_weights()) == {"model.embed_tokens.weight", "model.stale.weight"}


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


def test_requests_leave_room_for_sglang_reserved_draft_slots(model_dir):
    # SGLang adds max(topk * steps, max draft tokens) to every prompt with EAGLE and refuses
    # prompt + reserved + max_new_tokens > context (TokenizerManager._validate_one_request).
    eng, fake = make_engine(model_dir)  # adaptive, candidate steps up to 7: 8 reserved
    assert eng.reserved_tokens == fake.reserved_tokens == 8
    eng.add_request(GenerationRequest("r", tuple(range(100))))
    assert fake.submitted["r#0"].sampling_dict()["max_new_tokens"] == 128 - 8 - 100
    assert fake.poll(0.0) == []  # SGLang would accept it
    with pytest.raises(ValueError, match="does not fit"):
        eng.add_request(GenerationRequest("p", tuple(range(120))))
    with pytest.raises(ValueError, match="does not fit"):
        eng.add_request(GenerationRequest("m", tuple(range(100)), SamplingParams(max_tokens=21)))
    eng.add_request(GenerationRequest("x", tuple(range(100)), SamplingParams(max_tokens=20)))  # fits exactly
    assert fake.submitted["x#0"].sampling_dict()["max_new_tokens"] == 20
    # The old default (context - prompt) is what SGLang refuses: the fake ends it as aborted.
    (call,) = generate_calls(GenerationRequest("old", tuple(range(100))), 128 - 100, True)
    fake.submit(call)
    (chunk,) = fake.poll(0.0)
    assert chunk.finish is FinishReason.ABORT and "context length" in chunk.error
    static, _ = make_engine(model_dir, adaptive=False, num_steps=4, eagle_topk=4, num_draft_tokens=8)
    assert static.reserved_tokens == 16  # topk * steps > draft tokens
    plain, _ = make_engine(model_dir, speculative_algorithm="none")
    assert plain.reserved_tokens == 0


def test_no_requests_while_kv_cache_is_released(model_dir):
    eng, fake = make_engine(model_dir)  # release_tags = ["kv_cache"]
    eng.release()
    with pytest.raises(ValueError, match="released"):
        eng.add_request(GenerationRequest("r", (1,)))
    assert ("submit", "r#0") not in fake.calls
    eng.resume()
    eng.add_request(GenerationRequest("r", (1,)))
    assert fake.calls[-1] == ("submit", "r#0")


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


def test_a_stream_that_raises_after_tokens_ends_with_them(stand_in, model_dir):
    """SGLang raises from generate_request on an abort with an error status (KV pool full...), after streaming:
    the completion still holds what was streamed, and the error."""

    def script():
        yield (0.0, sglang_chunk("q#0", [7, 8]))
        raise ValueError("Abort: KV cache pool is full")

    class Raising(list):
        def __iter__(self):
            return script()

    client, _ = stand_in({"q#0": Raising()})
    eng = SGLangEngine(model_dir, SGLangBackendConfig(speculative_algorithm="none"), client=client)
    eng.add_request(GenerationRequest("q", (1, 2), SamplingParams(max_tokens=20)))
    streamed, done = [], []
    for _ in range(100):
        steps, finished = eng.step()
        streamed += [t for s in steps for t in s.new_token_ids]
        done += finished
        if done:
            break
    (c,) = done
    assert streamed == [7, 8] and c.token_ids == [7, 8]
    assert c.finish_reason is FinishReason.ABORT and "KV cache pool is full" in c.error


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


def test_engine_client_flush_refusal_carries_sglang_message(stand_in):
    from tlt.services.rollout.sglang_backend.client import SGLangError

    client, tm = stand_in({})
    # flush_cache answers FlushCacheReqOutput(success, message), not a tuple
    with pytest.raises(SGLangError, match="pending requests"):
        client.flush_cache()


def test_without_sglang_the_backend_says_how_to_get_it(model_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(ModuleNotFoundError, match=r"tlt\[sglang\]"):
        SGLangEngine(model_dir, SGLangBackendConfig(draft_model_path="/drafter"), run_dir=str(tmp_path))
    assert (tmp_path / "sglang-adaptive-spec.json").exists()  # written before SGLang would start


def test_a_replica_lend_releases_and_a_take_back_resumes_the_sglang_engine(model_dir):
    """The colocated lend as the replica process runs it (services/rollout/replica.py) on the real adapter over
    the fake SGLang: Lend(true) releases the configured tags and answers; Lend(false) resumes before the request
    that follows it in the pipe is added."""
    from multiprocessing import Pipe

    from tlt.services.rollout.ipc import AddRequest, Lend, Reply
    from tlt.services.rollout.replica import ReplicaLoop

    eng, fake = make_engine(model_dir, release_tags=["kv_cache"])
    front, back = Pipe()
    loop = ReplicaLoop(eng, back, 0)
    front.send(Lend(7, True))
    loop._drain()
    reply = front.recv()
    assert isinstance(reply, Reply) and reply.cmd_id == 7 and not reply.error
    assert fake.calls == [("release", ("kv_cache",))]
    front.send(Lend(0, False))
    front.send(AddRequest(GenerationRequest("r", (1, 2), SamplingParams(max_tokens=2))))
    loop._drain()
    assert fake.calls[1] == ("resume", ("kv_cache",)) and eng.has_unfinished()
    assert not front.poll(0.1)  # cmd_id 0: nobody waits for an answer, and the request was accepted


def test_requests_of_adjacent_seeds_share_no_sample_seed():
    """Sample i of a seeded request went to SGLang with seed + i: seeds 5 and 6 (n = 4) shared three of their four
    sample seeds, so under deterministic inference sample i + 1 of one request was sample i of the other. Each
    sample now gets the native engine's key (seed_for), within SGLang's int64."""
    from tlt.services.rollout.sglang_backend.requests import sglang_sampling

    def seeds(seed: int) -> set[int]:
        return {sglang_sampling(SamplingParams(temperature=1.0, seed=seed), i, 16)["sampling_seed"] for i in range(4)}

    for seed in (5, 1000, -3, 2**63 - 1):
        assert len(seeds(seed)) == 4 and not seeds(seed) & seeds(seed + 1), seed
        assert all(0 <= s < 2**63 for s in seeds(seed))
