"""Weight hot-swap through gRPC UpdateWeights on two replicas.

A valid push is applied on every replica and bumps the version the next
completions carry, and the served tokens become those of the new weights
(checked against `transformers` running the same modified weights). Every
corrupted push (bad checksum, wrong shape, wrong dtype, unknown name,
truncated stream, stale version, no manifest) is refused with ok=false and a
reason, and changes nothing: same version, same tokens.

Real parts: the rollout server on 127.0.0.1, two replica processes with the
native engine, the weight format of `services/common/weights.py`, transformers
as the reference. Nothing is faked.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
import transformers

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.common.weights import iter_chunks, pack_state_dict
from tlt.services.rollout.client import RolloutClient, WeightPushError
from tlt.v1 import common_pb2, rollout_pb2

TOKEN = "s3cret-control-token"
PROMPTS = ["1+2=", "3*4=", "5-1=", "9+9="]
GREEDY = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("rollout_swap_model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(model_dir, replicas=2, control_token=TOKEN) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = RolloutClient(server.grpc_address, control_token=TOKEN, timeout_s=120)
    yield c
    c.close()


def rollout(client) -> list[rollout_pb2.Completion]:
    return sorted(client.batch_generate(PROMPTS, n=1, params=GREEDY), key=lambda c: c.prompt_index)


def hf_greedy(model_dir, state: dict[str, torch.Tensor]) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    out = []
    for p in PROMPTS:
        ids = tok.encode(p)
        gen = model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def push_raw(client, manifest, payload) -> rollout_pb2.UpdateWeightsResponse:
    return client.push_chunks(iter_chunks(manifest, payload, chunk_bytes=64 * 1024))


def test_hot_swap(client, model_dir):
    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    before = rollout(client)
    assert {c.versions.policy for c in before} == {0}
    assert [list(c.token_ids) for c in before] == hf_greedy(model_dir, original)

    # A valid full push: every weight perturbed.
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    resp = client.update_weights(new, kind="policy", version=1)
    assert resp.ok and resp.version == 1 and sorted(resp.replicas) == [0, 1]
    after = rollout(client)
    assert {c.versions.policy for c in after} == {1}
    assert {c.replica_id for c in after} == {0, 1}  # both replicas serve the new weights
    expected = hf_greedy(model_dir, new)
    assert [list(c.token_ids) for c in after] == expected
    assert expected != [list(c.token_ids) for c in before]  # the push really changed the policy
    status = client.status()
    assert status.versions.policy == 1 and all(r.versions.policy == 1 for r in status.replicas)

    # Corrupted pushes: each refused with a reason, nothing changes.
    good_m, good_p = pack_state_dict({"lm_head.weight": original["lm_head.weight"]}, common_pb2.WEIGHT_KIND_POLICY, 2)
    flipped = bytearray(good_p)
    flipped[len(flipped) // 2] ^= 0xFF
    wrong_shape_m, wrong_shape_p = pack_state_dict(
        {"lm_head.weight": original["lm_head.weight"][:-1]}, common_pb2.WEIGHT_KIND_POLICY, 2)
    wrong_dtype_m, wrong_dtype_p = pack_state_dict(
        {"lm_head.weight": original["lm_head.weight"].half()}, common_pb2.WEIGHT_KIND_POLICY, 2)
    unknown_m, unknown_p = pack_state_dict(
        {"lm_head.weight": original["lm_head.weight"], "model.not_a_layer.weight": torch.zeros(3)},
        common_pb2.WEIGHT_KIND_POLICY, 2)
    stale_m, stale_p = pack_state_dict({"lm_head.weight": original["lm_head.weight"]}, common_pb2.WEIGHT_KIND_POLICY, 1)
    no_kind_m = rollout_pb2.WeightManifest()
    no_kind_m.CopyFrom(good_m)
    no_kind_m.kind = common_pb2.WEIGHT_KIND_UNSPECIFIED
    bad = {
        "checksum": push_raw(client, good_m, flipped),
        "shape": push_raw(client, wrong_shape_m, wrong_shape_p),
        "dtype": push_raw(client, wrong_dtype_m, wrong_dtype_p),
        "unknown": push_raw(client, unknown_m, unknown_p),
        "not newer": push_raw(client, stale_m, stale_p),
        "truncated": client.push_chunks(iter([*list(iter_chunks(good_m, good_p, chunk_bytes=4096))[:-1]])),
        "manifest": client.push_chunks(iter([rollout_pb2.WeightChunk(data=b"abc")])),
        "kind": push_raw(client, no_kind_m, good_p),
    }
    for words, resp in bad.items():
        assert not resp.ok, words
        assert words in resp.error, (words, resp.error)
    with pytest.raises(WeightPushError, match="shape") as refused:
        client.update_weights({"lm_head.weight": torch.zeros(2, 2)}, kind="policy", version=5)
    # a refusal reports the version that still serves, so a pusher tells "already there" (the drafter
    # coordinator's republish) from a failure without reading the message
    assert refused.value.serving_version == 1 and bad["not newer"].version == 1 and bad["checksum"].version == 1
    with pytest.raises(WeightPushError) as refused:
        client.update_weights({"lm_head.weight": original["lm_head.weight"]}, kind="policy", version=1)
    assert refused.value.serving_version == 1
    still = rollout(client)
    assert {c.versions.policy for c in still} == {1}
    assert [list(c.token_ids) for c in still] == expected
    assert client.status().versions.policy == 1

    # A valid partial push (one tensor) through the same-host shared-memory path.
    partial = {"lm_head.weight": original["lm_head.weight"]}
    resp = client.update_weights(partial, kind="policy", version=2, shm=True)
    assert resp.ok and resp.version == 2
    final = rollout(client)
    assert {c.versions.policy for c in final} == {2}
    assert [list(c.token_ids) for c in final] == hf_greedy(model_dir, {**new, **partial})


def test_drafter_push_without_drafter_is_refused(client):
    resp = push_raw(client, *pack_state_dict({"fc.weight": torch.zeros(4, 4)}, common_pb2.WEIGHT_KIND_DRAFTER, 1))
    assert not resp.ok and "drafter" in resp.error
    assert client.status().versions.drafter == -1


def test_in_flight_sequence_straddling_a_swap_is_stamped_with_both_versions(server, client, model_dir):
    """A swap lands between steps; the running sequence continues on the new weights and says so."""
    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    v = client.status().versions.policy + 1
    body = {"model": server.model_name, "prompt": "1+2=", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[len("data: "):]))
            if len(chunks) == 3:  # mid-sequence: push new weights while it decodes
                resp = client.update_weights({"lm_head.weight": original["lm_head.weight"] * 1.5}, "policy", v)
                assert resp.ok
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    assert last["tlt_versions"]["policy"] == v
    assert last["tlt_versions"]["policy_min"] == v - 1


def test_grpc_completion_straddling_a_swap_carries_policy_min(server, client, model_dir):
    """The same over gRPC: WeightVersions.policy_min is set on a straddling completion, unset otherwise."""
    import threading
    import time

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    v = client.status().versions.policy + 1
    long = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("out", client.generate("1+2=", params=long)))
    worker.start()
    deadline = time.monotonic() + 60
    while not any(r.running for r in client.status().replicas) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert client.update_weights({"lm_head.weight": original["lm_head.weight"] * 1.5}, "policy", v).ok
    worker.join(120)
    (c,) = box["out"]
    assert c.versions.policy == v and c.versions.HasField("policy_min") and c.versions.policy_min == v - 1
    (after,) = client.generate("1+2=", params=GREEDY)
    assert after.versions.policy == v and not after.versions.HasField("policy_min")


def test_update_weights_needs_the_control_token(server, client, model_dir):
    import grpc

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    before = client.status().versions.policy
    for token in ("", "wrong"):
        with RolloutClient(server.grpc_address, control_token=token, timeout_s=30) as other:
            with pytest.raises(grpc.RpcError) as e:
                other.update_weights({"lm_head.weight": original["lm_head.weight"]}, "policy", before + 1)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert len(other.generate("1+2=", params=GREEDY)) == 1  # generation needs no token
    assert client.status().versions.policy == before


@pytest.fixture(scope="module")
def drafter_server(model_dir, tmp_path_factory):
    """One replica speculating with a learned (random) EAGLE drafter from a folder."""
    from tlt.model.drafter import Drafter, DrafterConfig

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    cfg = DrafterConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("drafter")
    Drafter(cfg, weights["model.embed_tokens.weight"], weights["lm_head.weight"]).save(folder)
    spec = {"mode": "adaptive", "drafter": "learned", "drafter_path": str(folder)}
    with ServerThread(model_dir, replicas=1, spec=spec) as s:
        c = RolloutClient(s.grpc_address, timeout_s=120)
        yield c
        c.close()


def test_drafter_hot_swap_keeps_outputs_lossless(drafter_server, model_dir):
    client = drafter_server
    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    expected = hf_greedy(model_dir, original)
    long = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    before = [client.generate(p, params=long)[0] for p in PROMPTS]  # one at a time: batch 1, SD on
    assert [list(c.token_ids) for c in before] == expected
    assert sum(c.spec.verify_steps for c in before) > 0
    assert {c.versions.drafter for c in before} == {0}  # the drafter loaded at start (common.proto)

    from tlt.model.drafter import Drafter, DrafterConfig

    cfg = DrafterConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    torch.manual_seed(4)
    own = Drafter(cfg, original["model.embed_tokens.weight"], original["lm_head.weight"]).state_dict()
    resp = client.update_weights(own, kind="drafter", version=1)
    assert resp.ok and resp.version == 1
    assert client.status().versions.drafter == 1
    after = [client.generate(p, params=long)[0] for p in PROMPTS]
    assert {c.versions.drafter for c in after} == {1}
    assert [list(c.token_ids) for c in after] == expected  # a new drafter changes speed, never tokens

    with pytest.raises(WeightPushError, match="embed"):  # the target's shared tensors are never pushed as drafter
        client.update_weights({**own, "embed.weight": original["model.embed_tokens.weight"]}, "drafter", 2)
    with pytest.raises(WeightPushError, match="shape"):
        client.update_weights({**own, "fc.weight": torch.zeros(3, 3)}, "drafter", 2)
    assert client.status().versions.drafter == 1


def test_restarted_replica_gets_every_pushed_tensor_not_only_the_last_push(model_dir):
    """A full push (v1) then a partial one (v2): a replica restarted after kill -9 must serve v1's tensors
    that v2 did not carry, not the model folder's (the pool replays what the replicas hold, not the last push);
    GetWeights likewise still serves v1's tensors under v2."""
    import os
    import signal
    import time

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    full = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    norm = {"model.norm.weight": full["model.norm.weight"] * 1.25}
    with ServerThread(model_dir, replicas=1, max_restarts=1) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        assert c.update_weights(full, "policy", 1).ok
        assert c.update_weights(norm, "policy", 2).ok
        want = rollout(c)
        version, got = c.get_weights(["lm_head.weight", "model.norm.weight"])
        assert version == 2 and torch.equal(got["lm_head.weight"], full["lm_head.weight"])
        assert torch.equal(got["model.norm.weight"], norm["model.norm.weight"])

        old = s.server.replica_pids()[0]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (s.server.pool.replicas[0].alive and s.server.replica_pids()[0] != old):
            assert time.monotonic() < deadline, "replica 0 was not restarted"
            time.sleep(0.1)
        after = rollout(c)
        assert {x.versions.policy for x in after} == {2}
        assert [list(x.token_ids) for x in after] == [list(x.token_ids) for x in want]


def test_a_command_to_a_dead_replica_fails_at_once(model_dir):
    """A command to a replica already marked dead (a restarted replica killed before its replay, or one dying just
    as a push is sent to it) must fail with ReplicaUnavailableError at once, not wait out the timeout: the
    replay waits under the update lock (every push would stall) and a push counts a timeout as a failed apply."""
    import os
    import signal
    import time

    from tlt.services.rollout.ipc import QueryStats
    from tlt.services.rollout.replicas import ReplicaUnavailableError

    with ServerThread(model_dir, replicas=1) as s:
        pool = s.server.pool
        rep = pool.replicas[0]
        os.kill(rep.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not rep.error:
            assert time.monotonic() < deadline, "the pool never saw the replica die"
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(ReplicaUnavailableError, match="replica 0 died"):
            s.call(pool._ask(rep, QueryStats, 20.0), timeout=40)
        assert time.monotonic() - t0 < 5


def test_a_prompt_prefilled_across_a_swap_is_stamped_with_both_versions(model_dir):
    """A long prompt is prefilled in chunks over several engine steps. A swap that lands between two of its chunks
    leaves the earlier chunks' K/V computed by the old weights, so every token it emits is of the new weights over
    old K/V: the completion must say policy_min = the old version, as a decode that straddles a swap does (the
    trainer reads it to tell a mixed sample). Engine level (the replica loop calls the same step/update_weights)
    so the swap lands mid-prefill deterministically."""
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    engine = LLMEngine(model_dir, EngineConfig(max_model_len=256, max_num_batched_tokens=16, block_size=16))
    prompt = tuple(range(5, 5 + 60))  # 60 prompt tokens: 4 chunks of at most 16
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(GenerationRequest("long", prompt, params))
    steps, finished = engine.step()
    assert not steps and not finished  # the first chunk only: nothing emitted yet
    engine.update_weights("policy", {"lm_head.weight": original["lm_head.weight"] * 1.5}, 1)
    done = []
    while engine.has_unfinished():
        done += engine.step()[1]
    (c,) = done
    assert c.versions.policy == 1 and c.versions.policy_min == 0


def test_drafter_push_with_integer_or_bool_tensors_is_refused(drafter_server, model_dir):
    """A drafter push is cast to the serving drafter's float dtype (the coordinator trains in fp32, a GPU rollout
    drafts in bf16), but an integer or bool tensor is no drafter weight: casting it would silently serve a broken
    drafter (acceptance ~1). It must be refused whole like any other malformed push, with the reason."""
    from tlt.model.drafter import Drafter, DrafterConfig

    client = drafter_server
    original = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    cfg = DrafterConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    torch.manual_seed(5)
    own = Drafter(cfg, original["model.embed_tokens.weight"], original["lm_head.weight"]).state_dict()
    serving = client.status().versions.drafter
    for dtype in (torch.int32, torch.bool):
        with pytest.raises(WeightPushError, match="dtype") as refused:
            client.update_weights({**own, "fc.weight": own["fc.weight"].to(dtype)}, "drafter", serving + 1)
        assert "replica 0: replica 0" not in str(refused.value)  # each replica named once in the reason
    assert client.status().versions.drafter == serving
    assert client.update_weights({k: v.half() for k, v in own.items()}, "drafter", serving + 1).ok  # float: cast


def test_a_push_is_assembled_off_the_event_loop(server, client, model_dir, monkeypatch):
    """Assembling a push (joining its chunks, or reading its /dev/shm file) takes seconds for a 7B model's 14 GB.
    Done on the event loop, it froze every HTTP stream, gRPC call and health check of the server meanwhile; it now
    runs in a worker thread. (Spied on the real function; a stale version, so the module's server is unchanged.)"""
    import threading

    from tlt.services.common import weights

    threads = []
    real = weights.assemble

    def spy(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(weights, "assemble", spy)
    state = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    for shm in (False, True):
        with pytest.raises(WeightPushError, match="not newer"):
            client.update_weights({"model.norm.weight": state["model.norm.weight"]}, "policy", 0, shm=shm)
    assert len(threads) == 2 and server._thread not in threads, threads


def test_a_push_whose_caller_goes_away_mid_apply_is_still_recorded(model_dir):
    """The push's RPC ended (its deadline; a killed trainer likewise) while the replica was applying it: the
    replica applied it anyway, but the pool never recorded it, so GetStatus and GetWeights said v0 while
    completions said v1, and a resumed trainer at v0 saw nothing to push (then StaleWeightsError at every resume).
    The replica is stopped (SIGSTOP) for 3 s to hold the push past the caller's 1.5 s deadline."""
    import os
    import signal
    import threading
    import time

    import grpc

    with ServerThread(model_dir, replicas=1, update_timeout_s=60.0) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c, RolloutClient(s.grpc_address, timeout_s=1.5) as short:
        _, w0 = c.get_weights(["lm_head.weight"])
        new = {"lm_head.weight": torch.zeros_like(w0["lm_head.weight"])}
        pid = s.server.replica_pids()[0]
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(3.0, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            with pytest.raises(grpc.RpcError) as e:
                short.update_weights(new, kind="policy", version=1)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            resume.join()
        deadline = time.monotonic() + 30
        while c.status().versions.policy != 1:
            assert time.monotonic() < deadline, "the pool never recorded the push its replica applied"
            time.sleep(0.1)
        done = c.generate("1+1=", params=GREEDY)[0]
        version, got = c.get_weights(["lm_head.weight"])
        assert done.versions.policy == version == 1 and not got["lm_head.weight"].any()


def test_a_push_whose_caller_goes_away_while_it_waits_for_an_earlier_one_is_dropped(model_dir):
    """Shielded whole, a push queued behind another ran later although nobody waited for it any more (and a
    retry of it was then refused as not newer). Only a push already sent to the replicas runs to its end."""
    import os
    import signal
    import threading
    import time

    import grpc

    with ServerThread(model_dir, replicas=1, update_timeout_s=60.0) as s, \
            RolloutClient(s.grpc_address, timeout_s=60) as c, RolloutClient(s.grpc_address, timeout_s=1.0) as short:
        _, w0 = c.get_weights(["lm_head.weight"])
        pid = s.server.replica_pids()[0]
        os.kill(pid, signal.SIGSTOP)  # the first push holds the pool's update lock while the replica is stopped
        first = threading.Thread(target=c.update_weights, args=({"lm_head.weight": w0["lm_head.weight"] + 1}, "policy", 1))
        first.start()
        try:
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as e:  # queued behind the first, past its deadline
                short.update_weights({"lm_head.weight": torch.zeros_like(w0["lm_head.weight"])}, "policy", 2)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            os.kill(pid, signal.SIGCONT)
            first.join(60)
        time.sleep(1.0)  # the queued push got the lock after the first: dropped, not applied
        version, got = c.get_weights(["lm_head.weight"])
        assert version == 1 and torch.equal(got["lm_head.weight"], w0["lm_head.weight"] + 1)
        assert c.status().versions.policy == 1 and c.generate("1+1=", params=GREEDY)[0].versions.policy == 1


def tied_checkpoint(out_dir: Path) -> Path:
    """`tiny_checkpoint` with tie_word_embeddings=true, saved as transformers saves a tied model: no lm_head.weight."""
    d = tiny_checkpoint(out_dir)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tensors = safetensors.torch.load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    safetensors.torch.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_a_tied_models_state_dict_push_serves_its_embedding(tmp_path):
    """`client.update_weights(model.state_dict(), ...)` (the client's documented use) of a tied model: HF's state
    dict carries lm_head.weight too, the embedding's storage. It was refused as "not in the model"; it must be
    applied and serve the pushed embedding (as transformers runs the same weights). A head that differs from the
    embedding, or comes without it, is refused and changes nothing."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    model_dir = tied_checkpoint(tmp_path / "tied")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # every weight perturbed, the tied one once
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = model.state_dict()
    assert state[head].data_ptr() == state[embed].data_ptr()  # tied: one storage under both names
    with ServerThread(model_dir, replicas=1) as s, RolloutClient(s.grpc_address, timeout_s=60) as c:
        before = [list(x.token_ids) for x in rollout(c)]
        assert c.update_weights(state, "policy", 1).ok
        after = rollout(c)
        assert {x.versions.policy for x in after} == {1}
        assert [list(x.token_ids) for x in after] == hf_greedy(model_dir, state) != before
        for bad, why in (({head: state[embed] + 1.0, embed: state[embed]}, "differs from"),
                         ({head: state[embed]}, "without")):
            with pytest.raises(WeightPushError, match=f"lm_head.weight {why} model.embed_tokens.weight"):
                c.update_weights(bad, "policy", 2)
        again = rollout(c)
        assert [list(x.token_ids) for x in again] == [list(x.token_ids) for x in after]
        assert {x.versions.policy for x in again} == {1}


def test_a_refused_push_reports_the_version_served_only_for_the_kind_it_pushed(model_dir):
    """WeightPushError.serving_version is what the refusal says the replicas serve of the pushed kind: -1 for a
    drafter push to a server without one; None when the push was refused before its kind was read (a stream over
    max_weight_bytes), not the 0 such an answer carries, which a caller would take for "serving version 0"."""
    with ServerThread(model_dir, replicas=1, max_weight_bytes=4096) as s, RolloutClient(s.grpc_address) as c:
        with pytest.raises(WeightPushError, match="max_weight_bytes") as e:
            c.update_weights({"fc.weight": torch.zeros(64, 64)}, kind="drafter", version=1)
        assert e.value.serving_version is None
        with pytest.raises(WeightPushError, match="drafter") as e:
            c.update_weights({"fc.weight": torch.zeros(4, 4)}, kind="drafter", version=1)
        assert e.value.serving_version == -1
        # a stream of exactly max_weight_bytes (32 x 32 float32 = 4096) is read whole: refused for its kind alone
        with pytest.raises(WeightPushError, match="drafter") as e:
            c.update_weights({"fc.weight": torch.zeros(32, 32)}, kind="drafter", version=1)
        assert "max_weight_bytes" not in str(e.value) and e.value.serving_version == -1
