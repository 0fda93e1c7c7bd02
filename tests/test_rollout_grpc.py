"""gRPC tlt.v1.Rollout over two replica processes: batch rollout streaming, Generate, status, spreading.

Real parts: the rollout server (grpc.aio on a free 127.0.0.1 port), two replica
processes running the native engine on a tiny random checkpoint, the project's
`RolloutClient`. Nothing is faked.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import transformers

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, rollout_pb2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("rollout_grpc_model"))


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(model_dir, replicas=2) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = RolloutClient(server.grpc_address, timeout_s=120)
    yield c
    c.close()


def test_batch_generate_n4_streams_every_sequence_with_versions(client, model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = ["1+2=", "3*4=", "5-1=", "9+9=", "2*2=", "7-3="]
    params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=12, seed=11)
    got = list(client.batch_generate(prompts, n=4, params=params, references=[f"ref{i}" for i in range(6)]))
    assert len(got) == 24
    assert sorted((c.prompt_index, c.sample_index) for c in got) == [(p, s) for p in range(6) for s in range(4)]
    for c in got:
        assert c.versions == common_pb2.WeightVersions(policy=0, drafter=-1)
        assert 1 <= len(c.token_ids) <= 12
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
        assert c.finish_reason in (rollout_pb2.FINISH_REASON_STOP, rollout_pb2.FINISH_REASON_LENGTH)
        assert list(c.prompt_token_ids) == tok.encode(prompts[c.prompt_index])
        assert c.text == tok.decode(list(c.token_ids), skip_special_tokens=True)
        assert c.reference == f"ref{c.prompt_index}"
    assert {c.replica_id for c in got} == {0, 1}  # least-loaded spreading used both replicas


def test_completions_stream_as_they_finish(client):
    """Short sequences arrive while a long one is still decoding (not all at the end).

    Timing on a shared 2-core box: one retry if the machine stalled the short batch."""
    params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # sampled (not greedy) from a random model: drafts are rarely accepted, so ~1 token per step
    long_params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=240, ignore_eos=True, seed=1)
    attempts = []
    for _ in range(2):
        arrivals: list[float] = []
        long_done: list[float] = []
        t0 = time.monotonic()

        def long_request() -> None:
            list(client.batch_generate(["8*8="], n=1, params=long_params))
            long_done.append(time.monotonic() - t0)

        t = threading.Thread(target=long_request)
        t.start()
        while not any(r.running for r in client.status().replicas) and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        for _ in client.batch_generate(["1+1=", "2+2="], n=2, params=params):
            arrivals.append(time.monotonic() - t0)
        t.join()
        assert len(arrivals) == 4 and len(long_done) == 1
        attempts.append((max(arrivals), long_done[0]))
        if max(arrivals) < long_done[0]:
            return
    pytest.fail(f"the 1-token sequences came back after the 240-token one: (last short, long) seconds = {attempts}")


def test_features_when_asked(client):
    params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, return_features=True)
    (c,) = client.generate("4+4=", n=1, params=params)
    assert c.hidden_size == 64
    feats = np.frombuffer(c.features, dtype=np.float16).reshape(len(c.token_ids), c.hidden_size)
    assert np.isfinite(feats).all() and np.abs(feats).sum() > 0


def test_generate_n2_sorted(client):
    res = client.generate([5, 6, 7], n=2, params=rollout_pb2.SamplingParams(max_tokens=4, seed=5))
    assert [c.sample_index for c in res] == [0, 1]
    assert all(list(c.prompt_token_ids) == [5, 6, 7] for c in res)


def test_status_shows_both_replicas_busy_then_idle(client):
    params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=150, ignore_eos=True)
    t = threading.Thread(target=lambda: list(client.batch_generate(["1+2=", "3+4="], n=4, params=params)))
    t.start()
    busy_seen: set[int] = set()
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline and len(busy_seen) < 2:
        st = client.status()
        busy_seen |= {r.replica_id for r in st.replicas if r.state == common_pb2.REPLICA_STATE_BUSY and r.running > 0}
        time.sleep(0.05)
    t.join()
    assert busy_seen == {0, 1}
    st = client.status()
    assert st.backend == "native"
    assert [r.replica_id for r in st.replicas] == [0, 1]
    for r in st.replicas:
        assert r.alive and r.device == "cpu"
        assert r.state == common_pb2.REPLICA_STATE_IDLE and r.running == 0 and r.queued == 0
        assert r.versions == common_pb2.WeightVersions(policy=0, drafter=-1)
        assert 0.0 <= r.kv_usage <= 1.0


def test_speculative_decoding_runs_in_the_tail(client):
    """The default [rollout.spec] (adaptive, n-gram drafter) switches on for a lone long sequence."""
    params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    (c,) = client.generate("1+2=", params=params)
    assert len(c.token_ids) == 80
    assert c.spec.verify_steps > 0 and c.spec.accepted_tokens >= c.spec.verify_steps
    assert c.spec.plain_decode_steps >= 1  # the prefill emits the first token plainly
    # >=, not ==: the engine counts a verify pass's accepted tokens before cutting them at max_tokens
    assert c.spec.plain_decode_steps + c.spec.accepted_tokens >= 80
    st = client.status()
    assert all(r.spec.mode == "adaptive" for r in st.replicas)
    assert sum(r.spec.verify_steps for r in st.replicas) > 0
    r = max(st.replicas, key=lambda r: r.spec.verify_steps)  # the replica that decoded it
    assert r.spec.plain_steps >= 1 and r.spec.last_step_seconds > 0
    assert sum(a.steps for a in r.spec.arms) == r.spec.verify_steps and all(a.accept_len >= 1 for a in r.spec.arms)
    # one bandit choice per verify step, counted per bucket and per arm
    assert sum(b.explored + b.exploited for b in r.spec.bandit) == r.spec.verify_steps
    assert sum(a.chosen for b in r.spec.bandit for a in b.arms) == r.spec.verify_steps
    assert [b.bucket for b in r.spec.bandit] == ["1", "2-4", "5-20", ">=21"]

def test_replica_death_moves_its_requests_and_the_other_keeps_serving(server, client):
    """Runs last in this module: it kills replica 1 (a process this test's server started). Its request is
    re-dispatched to replica 0 (`redispatch_limit`; the failure it gave before: tests/test_rollout_redispatch.py)."""
    import os
    import signal

    import grpc
    import httpx

    params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
    errors: list[grpc.RpcError] = []
    outs: list[rollout_pb2.Completion] = []

    def long_batch() -> None:
        try:
            outs.extend(client.batch_generate(["1+2=", "3+4="], n=2, params=params))
        except grpc.RpcError as e:
            errors.append(e)

    t = threading.Thread(target=long_batch)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(r.running > 0 for r in client.status().replicas):
        time.sleep(0.05)
    metrics_url = server.base_url.removesuffix("/v1") + "/metrics"
    assert 'rollout_replica_running{replica="1"} 0.0' not in httpx.get(metrics_url).text  # scraped while it ran
    os.kill(server.server.replica_pids()[1], signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert not errors, errors
    assert sorted((c.prompt_index, c.sample_index) for c in outs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {c.replica_id for c in outs} == {0} and all(len(c.token_ids) == 200 for c in outs)

    st = client.status()
    assert [(r.replica_id, r.alive) for r in st.replicas] == [(0, True), (1, False)]
    # a dead replica says DRAINING (what its capacity events say), not UNSPECIFIED, a state no client handles
    assert [r.state for r in st.replicas] == [common_pb2.REPLICA_STATE_IDLE, common_pb2.REPLICA_STATE_DRAINING]
    got = list(client.batch_generate(["5+5=", "6+6="], n=2, params=rollout_pb2.SamplingParams(max_tokens=4)))
    assert len(got) == 4 and {c.replica_id for c in got} == {0}
    # a dead replica's gauges say it runs nothing (its last scrape's running count and SD state stayed on show)
    text = httpx.get(metrics_url).text
    assert 'rollout_replica_alive{replica="1"} 0.0' in text and 'rollout_replica_running{replica="1"} 0.0' in text
    assert 'rollout_replica_queued{replica="1"} 0.0' in text and 'rollout_replica_kv_usage{replica="1"} 0.0' in text
    health = httpx.get(server.base_url.removesuffix("/v1") + "/health")
    # still serving (200: a health check must not restart the server), but not "ok": one replica of two is gone
    assert health.status_code == 200 and health.json() == {"status": "degraded", "replicas_alive": 1, "replicas": 2}


def test_batch_generate_references_must_match_the_prompts():
    """One reference per prompt: a shorter list silently dropped the prompts past it (zip), a trainer's batch
    came back smaller than it asked for."""
    with RolloutClient("127.0.0.1:9") as c:  # refused before anything is sent
        with pytest.raises(ValueError, match="3 prompts but 2 references"):
            c.batch_generate(["1+1=", "2+2=", "3+3="], references=["2", "4"])


def test_prompt_text_is_tokenized_off_the_event_loop(server, client, monkeypatch):
    """A slow tokenizer takes ~2 s a MB, and a gRPC message may hold 256 MB: encoded on the event loop, one big
    text prompt froze every other call and /health for tens of seconds (10 MB: 30 s) before it was refused for its
    length. (Spied on the front's real tokenizer class.)"""
    import grpc

    threads = []
    tokenizer = type(transformers.AutoTokenizer.from_pretrained(server.server.model_dir))
    real = tokenizer.encode

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    with pytest.raises(grpc.RpcError) as e:
        client.generate("1+2= " * 300, params=rollout_pb2.SamplingParams(max_tokens=2))  # short of the probe: tokenised whole, then refused
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context length" in e.value.details()
    assert threads and server._thread not in threads, threads
    assert client.generate("1+2=", params=rollout_pb2.SamplingParams(max_tokens=2))[0].token_ids


def test_a_seeded_batch_samples_each_prompt_with_its_own_seed(client):
    """One seed for the whole request gave every prompt the same random numbers: the same prompt twice in a seeded
    BatchGenerate came back as two copies (other prompts drew correlated samples). Prompt i now draws from
    prompt_seed(seed, i) (engine/sequence.py): prompt 0 from the request's seed itself, as a Generate does."""
    params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=23)

    def drawn() -> dict[tuple[int, int], list[int]]:
        return {(c.prompt_index, c.sample_index): list(c.token_ids)
                for c in client.batch_generate(["3+4=", "3+4="], n=2, params=params)}

    batch = drawn()
    assert sorted(batch) == [(p, k) for p in range(2) for k in range(2)]
    assert [batch[0, k] for k in range(2)] != [batch[1, k] for k in range(2)], "the same prompt twice, sampled alike"
    alone = client.generate("3+4=", n=2, params=params)
    assert [list(c.token_ids) for c in alone] == [batch[0, k] for k in range(2)]  # prompt 0: the request's seed
    assert drawn() == batch  # seeded: the whole batch again, whichever replica runs which prompt


def test_prompt_seeds_keep_prompt_0_s_and_are_distinct_int64s():
    from tlt.services.rollout.engine.sequence import prompt_seed
    from tlt.services.rollout.types import SamplingParams

    limit = SamplingParams.SEED_LIMIT
    for seed in (0, 23, -1, -limit, limit - 1):
        derived = [prompt_seed(seed, i) for i in range(64)]
        assert derived[0] == seed and len(set(derived)) == 64, seed
        assert all(-limit <= s < limit for s in derived)  # a valid seed, wherever it travels (int64)
    assert prompt_seed(None, 3) is None  # unseeded stays unseeded
    assert prompt_seed(23, 1) == prompt_seed(23, 1) != prompt_seed(24, 1)


def test_unset_sampling_fields_take_the_openai_defaults():
    """A trainer's SamplingParams leaves unset what it does not choose: that is temperature 1, top_p 1, no top_k or
    min_p, no seed (a fresh draw each call, not seed 0's same samples every step) and max_tokens up to the
    context, not greedy copies of one sample or a refused max_tokens=0; the sampled tokens' logprobs always come (the
    trainer's old logprobs). Set fields, zeros included, are kept."""
    from tlt.services.rollout.grpc_api import sampling_params
    from tlt.services.rollout.types import SamplingParams

    assert sampling_params(rollout_pb2.SamplingParams()) == SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, max_tokens=None, logprobs=0)
    got = sampling_params(rollout_pb2.SamplingParams(temperature=0.0, top_k=3, seed=0, max_tokens=5))
    assert (got.temperature, got.top_k, got.seed, got.max_tokens) == (0.0, 3, 0, 5)



def test_status_names_a_push_dtype_only_when_every_tensor_has_it():
    """GetStatus.dtype is the dtype every pushed policy tensor must have (the trainer checks its push_dtype against
    it before its first step). A model whose tensors differ (fp32 norms beside bf16 weights) has no such dtype: it
    says "", not one of them picked at random, which refused a valid trainer or passed one every push fails."""
    from types import SimpleNamespace

    from tlt.services.rollout.grpc_api import push_dtype

    def info(*dtypes: str) -> SimpleNamespace:
        return SimpleNamespace(expected_weights={f"w{i}": ((4,), d) for i, d in enumerate(dtypes)})

    assert push_dtype(info("bfloat16", "bfloat16")) == "bfloat16"
    assert push_dtype(info("bfloat16", "float32", "bfloat16")) == ""
    assert push_dtype(info()) == "" and push_dtype(SimpleNamespace()) == ""  # nothing known yet


def test_status_spec_says_off_without_a_decoder_and_accept_len_per_sequence():
    """GetStatus's speculative-decoding view: a replica with no decoder attached (empty stats) says mode "off" (a
    dashboard told "unknown" could not tell it from a broken export), and an arm's accept_len is tokens per
    sequence per verify step (the decoder's own definition, spec/decoder.py), not per batched verify step: 2 verify
    steps of 2 sequences each emitting 12 tokens is 3.0, not 6.0. (A stats dict of the decoder's shape, hand-made:
    the tiny test server's lone sequences make the two equal.)"""
    from tlt.services.rollout.grpc_api import spec_status

    assert spec_status({}).mode == "off" and spec_status({}, "adaptive").mode == "off"
    st = spec_status({"mode": "static", "arms": {"4_2_8": {"verify_steps": 2, "seq_steps": 4, "emitted": 12},
                                                 "2_1_2": {"verify_steps": 0, "seq_steps": 0, "emitted": 0}}})
    assert [(a.arm, a.steps, a.accept_len) for a in st.arms] == [("4_2_8", 2, 3.0), ("2_1_2", 0, 0.0)]

def test_generate_lists_samples_that_finish_out_of_order_by_index(server, client):
    """Generate's completions come sorted by sample_index even when the samples finish out of order (each stops
    at the first of a third of the vocabulary it draws): `completions[i]` is sample i."""
    vocab = server.server.pool.info.vocab_size
    params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=24, seed=3,
                                        stop_token_ids=list(range(3, vocab, 3))[:1024])
    res = client.generate("1+1=", n=6, params=params)
    assert [c.sample_index for c in res] == list(range(6))
    # a sample that ended early stopped (FINISH_REASON_STOP: what a trainer tells from a truncated one), else LENGTH
    stopped = [len(c.token_ids) < 24 or c.token_ids[-1] in params.stop_token_ids for c in res]
    assert [c.finish_reason for c in res] == [rollout_pb2.FINISH_REASON_STOP if s else rollout_pb2.FINISH_REASON_LENGTH
                                              for s in stopped]
    lengths = [len(c.token_ids) for c in res]
    assert lengths != sorted(lengths), lengths  # they finished out of index order: else this test could not fail


def test_top_logprobs_pair_each_id_with_its_own_logprob(client):
    """A Completion's top_logprobs hold ids and logprobs side by side, most likely first: greedy, each position's
    first alternative is the token taken, with the token's own logprob, and the logprobs never rise."""
    (c,) = client.batch_generate(["2*3="], params=rollout_pb2.SamplingParams(
        temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True))
    assert len(c.top_logprobs) == len(c.token_ids) == len(c.logprobs) == 5
    for tid, lp, alt in zip(c.token_ids, c.logprobs, c.top_logprobs):
        assert len(alt.token_ids) == len(alt.logprobs) == 3
        assert alt.token_ids[0] == tid and alt.logprobs[0] == pytest.approx(lp, abs=1e-5)
        assert list(alt.logprobs) == sorted(alt.logprobs, reverse=True)


def test_each_completion_carries_its_own_prompt_s_reference(client):
    """The reference (the answer a reward checks against) goes with its prompt, a text or token ids, and comes back
    on every sample of it: a token-id prompt's reference lost on the way was an empty answer to score against."""
    refs = {0: "two", 1: "four", 2: "six"}
    outs = list(client.batch_generate(["1+1=", [5, 6, 7], "3+3="], n=2, references=list(refs.values()),
                                      params=rollout_pb2.SamplingParams(max_tokens=2)))
    assert sorted((c.prompt_index, c.reference) for c in outs) == sorted((i, r) for i, r in refs.items() for _ in "ab")


def test_two_batches_with_one_batch_id_run_side_by_side(server, client):
    """`batch_id` is the caller's label (a trainer's step), not a key: a step retried under the same id while its
    first stream still runs (a client that timed out and asked again) must be served, not refused as 'request id
    already in flight' (the pool's request ids were the batch id's, with nothing to tell the two calls apart)."""
    params = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True, seed=2)
    first: list = []
    t = threading.Thread(target=lambda: first.extend(client.batch_generate(["1+2=", "3+4="], params=params,
                                                                          batch_id="step-7")))
    t.start()
    deadline = time.monotonic() + 30
    while server.server.pool.pending_sequences < 2:
        assert time.monotonic() < deadline, "the first batch never reached the replicas"
        time.sleep(0.005)
    again = list(client.batch_generate(["5+6="], params=rollout_pb2.SamplingParams(max_tokens=2), batch_id="step-7"))
    t.join(60)
    assert len(again) == 1 and len(first) == 2 and all(len(c.token_ids) == 120 for c in first)
