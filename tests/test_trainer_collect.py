"""Rollout collection over several gRPC streams with rewards scored as completions arrive.

Real rollout server on 127.0.0.1, one for the module (two clients on it stand
in for two rollout servers: two concurrent BatchGenerate streams, prompts split
between them). The reward source is an in-process recorder, so the test can see
which prompt and answer each completion was scored against and when.
"""

from __future__ import annotations

import threading
import time

import pytest

from rollout_helpers import ReplicaDied, ServerThread
from tlt.services.trainer.collect import RolloutError, collect, collect_retrying, sampling_params, wait_serving
from tlt.services.trainer.rewards import RewardResult
from tlt.services.trainer.types import PromptItem


class Recorder:
    """A reward source that remembers every submission (and when results() was asked for)."""

    def __init__(self) -> None:
        self.submits: list[tuple[float, str, str, str, str]] = []
        self.extras: dict[str, dict] = {}
        self.results_at = 0.0
        self.threads: set[int] = set()

    def begin(self):
        rec = self

        class Batch:
            def submit(self, key, prompt, completion, answer, extra=None, **kw):  # kw: messages, completion_ids
                rec.threads.add(threading.get_ident())
                rec.submits.append((time.perf_counter(), key, prompt, completion, answer))
                rec.extras[key] = extra

            def results(self):
                rec.results_at = time.perf_counter()
                return {k: RewardResult(float(len(c)), True) for _, k, _, c, _ in rec.submits}

            def cancel(self):
                pass

        return Batch()

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def server(random_model_dir):
    with ServerThread(random_model_dir, replicas=1) as s:
        yield s


def test_collect_over_two_streams(random_model_dir, server):
    from transformers import AutoTokenizer

    from tlt.services.rollout.client import RolloutClient

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    prompts = [PromptItem(i, f"<|im_start|>user\nCompute mod 10: {i} +{i + 1}<|im_end|>\n<|im_start|>assistant\n",
                          str(i), extra={"solution": f"s{i}"} if i % 2 else {}) for i in range(5)]
    rec = Recorder()
    clients = [RolloutClient(server.grpc_address), RolloutClient(server.grpc_address)]
    try:
        res = collect(prompts, clients, rec, n=3, params=sampling_params(8, 1.0, 1.0), step=7)
    finally:
        for c in clients:
            c.close()
    assert len(res.samples) == 15
    assert sorted((s.prompt_index, s.sample_index) for s in res.samples) == [(g, k) for g in range(5) for k in range(3)]
    by_key = {k: (p, a) for _, k, p, _, a in rec.submits}
    for s in res.samples:
        item = prompts[s.prompt_index]
        # the completion was generated from this prompt and scored against its own answer
        assert list(s.prompt_ids) == tok.encode(item.prompt)
        assert by_key[f"7-{s.prompt_index}-{s.sample_index}"] == (item.prompt, item.answer)
        assert rec.extras[f"7-{s.prompt_index}-{s.sample_index}"] == item.extra  # the row's other columns too
        assert s.reward == float(len(s.text)) and 1 <= len(s.response_ids) <= 8
        assert s.rollout_logprobs is not None and len(s.rollout_logprobs) == len(s.response_ids)
        assert s.policy_version == 0
    # every completion was handed to the reward source before results() was asked for, all from one thread
    assert max(t for t, *_ in rec.submits) <= rec.results_at and len(rec.threads) == 1
    assert res.times["rollout_s"] > 0 and res.times["reward_tail_s"] >= 0


def test_rollout_failure_fails_the_step(server):
    from tlt.services.rollout.client import RolloutClient

    with RolloutClient(server.grpc_address) as client:
        # max_tokens beyond the context length: the server refuses the batch (INVALID_ARGUMENT)
        with pytest.raises(RolloutError, match=f"rollout server {server.grpc_address} failed: StatusCode.INVALID_ARGUMENT"):
            collect([PromptItem(0, "hello", "1")], [client], Recorder(), n=2,
                    params=sampling_params(100_000, 1.0, 1.0), step=0)



def test_a_prompt_too_long_names_the_data_sets_item_not_its_place_in_the_request(server):
    """The server refuses "prompt 1 has at least N tokens"; the step's error said that alone, and 1 is the prompt's
    place in this step's request, no row of the file. It now names the data set's item (and the command that names
    its line)."""
    from tlt.services.rollout.client import RolloutClient

    long_text = "12+34=46 and " * 2000
    with RolloutClient(server.grpc_address) as client:
        with pytest.raises(RolloutError) as e:
            collect([PromptItem(5, "1+1=", "2"), PromptItem(37, long_text, "1")], [client], Recorder(), n=1,
                    params=sampling_params(4, 1.0, 1.0), step=0)
    assert "prompt 1 " in str(e.value) and "the data set's item 37" in str(e.value), str(e.value)
    assert "tlt data check" in str(e.value)

def test_a_request_that_cannot_be_sent_fails_the_step_instead_of_waiting_forever(server):
    # a reader thread that died of anything but a gRPC error never said so, and collect waited on its queue forever
    from tlt.services.rollout.client import RolloutClient

    result: list = []
    with RolloutClient(server.grpc_address) as client:
        def run() -> None:
            try:
                collect([PromptItem(0, "half an emoji \ud83d", "1")], [client], Recorder(), n=2,
                        params=sampling_params(4, 1.0, 1.0), step=0)
            except Exception as e:  # noqa: BLE001 - the test looks at it
                result.append(e)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "collect still waiting after 30 s"
    assert isinstance(result[0], RolloutError) and "UnicodeEncodeError" in str(result[0])


@pytest.mark.parametrize("servers", [1, 2])
def test_the_same_prompt_twice_in_one_step(random_model_dir, server, servers):
    """The sampler wraps around an epoch inside one step (or the data has fewer prompts than a step asks for):
    the same PromptItem object then appears twice; each occurrence is its own group of n samples."""
    from transformers import AutoTokenizer

    from tlt.services.rollout.client import RolloutClient

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    a, b = PromptItem(0, "prompt a", "1"), PromptItem(1, "the other prompt", "2")
    prompts = [a, b, a]
    rec = Recorder()
    clients = [RolloutClient(server.grpc_address) for _ in range(servers)]
    try:
        res = collect(prompts, clients, rec, n=2, params=sampling_params(8, 1.0, 1.0), step=3)
    finally:
        for c in clients:
            c.close()
    assert sorted((s.prompt_index, s.sample_index) for s in res.samples) == [(g, k) for g in range(3) for k in range(2)]
    for s in res.samples:  # the completion landed in its own prompt's group
        assert list(s.prompt_ids) == tok.encode(prompts[s.prompt_index].prompt)


def test_a_chat_row_reaches_the_rollout_rendered_and_its_reward_function_as_trl_calls_it(random_model_dir, server,
                                                                                          tmp_path):
    """A TRL conversational row loaded the trainer's way (trainer_prompts: the policy's chat template) is generated
    from its rendered text; its reward function gets the messages, `[{"role": "assistant", ...}]` completions and
    the token ids the rollout returned (`completion_ids`), as TRL's GRPOTrainer passes them."""
    import json

    from transformers import AutoTokenizer

    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import trainer_prompts
    from tlt.services.trainer.rewards import FunctionRewards

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute mod 10: 3 +4"}]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": chat, "reward_model": {"ground_truth": "7"}}) + "\n")
    items = trainer_prompts(TrainerConfig(model_dir=str(random_model_dir), data_path=str(data),
                                          answer_field="reward_model.ground_truth"))
    seen = {}

    def trl_reward(prompts, completions, completion_ids, **kw):
        seen.update(kw, prompts=prompts, completions=completions, completion_ids=completion_ids)
        return [float(len(i)) for i in completion_ids]

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    with RolloutClient(server.grpc_address) as client:
        res = collect(items, [client], FunctionRewards([trl_reward]), n=2, params=sampling_params(8, 1.0, 1.0), step=1)
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert sorted(s.sample_index for s in res.samples) == [0, 1]
    for j, s in enumerate(res.samples):  # the samples in the order they were scored
        assert list(s.prompt_ids) == tok.encode(rendered)
        assert seen["completion_ids"][j] == list(s.response_ids) and s.reward == len(s.response_ids)
        assert seen["completions"][j] == [{"role": "assistant", "content": s.text}]
    assert seen["prompts"] == [chat, chat] and seen["answer"] == ["7", "7"]


def _prompts(k: int) -> list[PromptItem]:
    return [PromptItem(i, f"<|im_start|>user\nCompute mod 10: {i} +{i + 1}<|im_end|>\n<|im_start|>assistant\n", str(i))
            for i in range(k)]


def test_a_rollout_server_that_stays_down_is_named_with_why_once_the_retries_are_spent(server):
    """Two rollout servers, one of them gone: the step's retry waited for its replicas and failed with "the rollout
    replicas did not all serve again ... (replica_restart_failed?)", naming neither the server nor why."""
    from tlt.services.common.ports import free_port
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.rewards import task_rewards

    dead = f"127.0.0.1:{free_port()}"
    clients = [RolloutClient(server.grpc_address), RolloutClient(dead)]
    try:
        with pytest.raises(RolloutError) as e:
            collect_retrying(_prompts(2), clients, task_rewards(), 1, sampling_params(4, 1.0, 1.0), 0, retries=1,
                             wait_s=1.0)
    finally:
        for c in clients:
            c.close()
    message = str(e.value)
    assert f"{dead}: StatusCode.UNAVAILABLE" in message, message
    assert server.grpc_address not in message, message  # the server that serves is not blamed


def test_a_rollout_server_whose_status_hangs_is_waited_for_no_longer_than_the_retry_wait():
    """GetStatus had no deadline (the trainer's clients have none): a rollout front that accepted the call and never
    answered held wait_serving past `rollout_retry_wait_s`, for as long as the connection stayed up. Real gRPC."""
    from concurrent import futures

    import grpc

    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2_grpc

    release = threading.Event()

    class Hanging(rollout_pb2_grpc.RolloutServicer):
        def GetStatus(self, request, context):  # noqa: ANN001, N802
            release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    front = grpc.server(futures.ThreadPoolExecutor(4))
    rollout_pb2_grpc.add_RolloutServicer_to_server(Hanging(), front)
    address = f"127.0.0.1:{front.add_insecure_port('127.0.0.1:0')}"
    front.start()
    outcome: list = []
    client = RolloutClient(address)
    try:
        def run() -> None:
            t0 = time.monotonic()
            try:
                wait_serving([client], 1.0)
            except RolloutError as e:
                outcome.append((time.monotonic() - t0, str(e)))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "wait_serving still waiting on the hanging server after 10 s (its timeout was 1 s)"
    finally:
        release.set()
        client.close()
        front.stop(0)
    took, message = outcome[0]
    assert took < 3 and f"{address}: StatusCode.DEADLINE_EXCEEDED" in message, (took, message)


class _Edited:
    """A rollout client whose streams are the real server's, each completion passed through `edit` (None: dropped),
    as a server that lost a sample or sent logprobs of another length than its tokens would send them."""

    def __init__(self, real, edit) -> None:  # noqa: ANN001 - RolloutClient, (Completion) -> Completion | None
        self.real, self.address, self.edit = real, real.address, edit

    def status(self):  # noqa: ANN201
        return self.real.status()

    def batch_generate(self, *args, **kw):  # noqa: ANN002, ANN003, ANN201
        inner, edit = self.real.batch_generate(*args, **kw), self.edit

        class Stream:
            def __iter__(self):
                for c in inner:
                    if (c := edit(c)) is not None:
                        yield c

            def cancel(self) -> None:
                inner.cancel()

        return Stream()


def _dies_once(real, after: int) -> _Edited:  # noqa: ANN001 - RolloutClient
    """A rollout client whose first stream ends with UNAVAILABLE after `after` completions, as the stream of a
    server whose replica died (and whose samples could not be re-dispatched) ends; later streams are the server's."""
    seen = [0]

    def edit(c):  # noqa: ANN001, ANN202
        seen[0] += 1
        if seen[0] == after + 1:
            raise ReplicaDied()
        return c

    return _Edited(real, edit)


def test_a_dropped_partial_rollout_s_reward_calls_are_cancelled(server):
    """A step whose stream ended UNAVAILABLE is rolled out again and its partial rollout dropped; the reward calls
    submitted for the dropped completions went on (the reward server scored 6 completions nobody used) and held the
    client's concurrency ahead of the retried step's. Cancelling the batch then dropped only the calls still in the
    client's queue: those already sent (here all 6: concurrency 8) were scored by the server, the redo's items
    waiting behind them. Now the sent ones are cancelled too: of the dropped completions only those the server's 2
    workers had begun are scored. Real rollout and reward servers."""
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.rewards import GrpcRewards

    scored: list[str] = []
    lock = threading.Lock()

    def slow(prompt: str, completion: str, reference: str) -> bool:
        with lock:
            scored.append(completion)
        time.sleep(0.3)
        return True

    workers = 2
    with RewardServer(RewardConfig(host="127.0.0.1", port=0, workers=workers), verifier=slow) as reward_server:
        rewards = GrpcRewards(reward_server.address, concurrency=8, timeout_s=10, retries=0)
        try:
            with RolloutClient(server.grpc_address) as real:
                res = collect_retrying(_prompts(4), [_dies_once(real, after=6)], rewards, 4,
                                       sampling_params(8, 1.0, 1.0), 0, retries=1, wait_s=10)
        finally:
            rewards.close()
    n_scored, n_samples = len(scored), len(res.samples)
    assert res.retries == 1 and n_samples == 16
    assert n_scored <= n_samples + workers, f"{n_scored} completions scored for {n_samples}"


def test_each_server_s_request_of_each_step_gets_its_own_seed_derived_from_the_run_alone():
    """The trainer sent no seed: the rollout drew one from its per-process counter, so a resumed run (its services
    restarted) rolled the steps after its checkpoint out other than the killed run had. Now each rollout server's
    request is seeded from the run's seed, the step (round, eval) and the server's place: the same in any process,
    and distinct for another server, step, round, eval or run seed."""
    import os
    import subprocess
    import sys

    from tlt.services.trainer.collect import request_seed, server_params

    keys = [(0, 3, 0), (0, 3, 1), (0, 4, 0), (0, "3.1", 0), (0, "eval3", 0), (1, 3, 0), (-1, 3, 0), (2**70, 3, 0)]
    seeds = [request_seed(*k) for k in keys]
    assert len(set(seeds)) == len(keys), seeds
    assert all(0 <= s < 2**63 for s in seeds)  # SamplingParams.seed is an int64
    # not Python's hash() (salted per process): another interpreter, another hash seed, the same seed
    code = "from tlt.services.trainer.collect import request_seed; print(request_seed(0, '3.1', 0))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)
    assert int(other.stdout) == request_seed(0, "3.1", 0)
    run = sampling_params(8, 1.0, 1.0, seed=5)
    own = server_params(run, 3, 1)
    assert own.seed == request_seed(5, 3, 1) and run.seed == 5  # the run's params stay as they were
    assert own.max_tokens == 8 and own.logprobs == 0 and own.HasField("temperature")
    assert sampling_params(8, 1.0, 1.0, seed=-1).seed == 2**63 - 1  # any config seed fits the int64 field
    assert not server_params(sampling_params(8, 1.0, 1.0), 3, 1).HasField("seed")  # unseeded stays unseeded


@pytest.mark.parametrize("servers", [1, 2])
def test_a_seeded_step_samples_the_same_completions_again_and_each_prompt_its_own(server, servers):
    """A seeded rollout (the trainer's: sampling_params(seed=run's seed)) samples the same step the same again, or
    redone after a replica died, and another step others; each prompt gets its own samples, the same prompt
    twice in one request (the rollout seeds its prompts apart) or on two servers (each server's request its own
    seed) too. Unseeded, a step sampled other completions each time it ran."""
    from tlt.services.rollout.client import RolloutClient

    a, b = _prompts(2)
    prompts = [a, b, a, a]  # two servers: prompts 0 and 2 on the first, 3 (the second's prompt 0) on the other
    params = sampling_params(8, 1.0, 1.0, seed=11)

    def drawn(res) -> dict[tuple[int, int], tuple[int, ...]]:  # noqa: ANN001
        return {(s.prompt_index, s.sample_index): s.response_ids for s in res.samples}

    clients = [RolloutClient(server.grpc_address) for _ in range(servers)]
    try:
        first = drawn(collect(prompts, clients, Recorder(), n=2, params=params, step=5))
        again = drawn(collect(prompts, clients, Recorder(), n=2, params=params, step=5))
        later = drawn(collect(prompts, clients, Recorder(), n=2, params=params, step=6))
        redone = collect_retrying(prompts, [_dies_once(clients[0], after=1), *clients[1:]], Recorder(), 2, params, 5,
                                  retries=1, wait_s=10)
    finally:
        for c in clients:
            c.close()
    assert again == first and drawn(redone) == first and redone.retries == 1
    groups = {g: tuple(first[g, k] for k in range(2)) for g in (0, 2, 3)}  # prompt a's three groups
    assert len(set(groups.values())) == 3, "the same prompt twice, sampled alike"
    assert later != first, "another step sampled the same completions"


def test_a_stream_that_ends_short_of_a_sample_fails_the_step(server):
    """A stream that ended cleanly with one completion missing: the step must fail, not train on a group short of a
    sample (the check counted completions against the prompts, not prompts x n, and let 7 of 8 through)."""
    from tlt.services.rollout.client import RolloutClient

    def drop_one(c):  # noqa: ANN001, ANN202
        return None if (c.prompt_index, c.sample_index) == (1, 3) else c

    with RolloutClient(server.grpc_address) as real:
        with pytest.raises(RolloutError, match="rollout returned 7 completions, expected 8"):
            collect(_prompts(2), [_Edited(real, drop_one)], Recorder(), n=4, params=sampling_params(4, 1.0, 1.0),
                    step=0)


def test_logprobs_of_another_length_than_the_tokens_are_not_kept(server):
    """The rollout's logprobs stand in for the trainer's old logprobs ([trainer] old_logprobs = "rollout") token by
    token: a completion whose logprobs are not one per response token keeps none (the step recomputes them), never
    a list shifted against its tokens."""
    from tlt.services.rollout.client import RolloutClient

    def one_short(c):  # noqa: ANN001, ANN202
        if c.prompt_index == 0:
            del c.logprobs[-1]
        return c

    with RolloutClient(server.grpc_address) as real:
        res = collect(_prompts(2), [_Edited(real, one_short)], Recorder(), n=2, params=sampling_params(4, 1.0, 1.0),
                      step=0)
    kept = {s.prompt_index: s.rollout_logprobs for s in res.samples}
    assert kept[0] is None
    assert kept[1] is not None and all(len(s.rollout_logprobs) == len(s.response_ids)
                                       for s in res.samples if s.prompt_index == 1)


def test_a_step_is_rolled_out_at_most_retries_plus_one_times(server):
    """`rollout_retries = 1`: one redo, then the step fails; a stream that dies every time was rolled out a third
    time (two redos)."""
    from tlt.services.rollout.client import RolloutClient

    calls: list[int] = []

    def dies(c):  # noqa: ANN001, ANN202
        raise ReplicaDied()

    class Counting(_Edited):
        def batch_generate(self, *args, **kw):  # noqa: ANN002, ANN003, ANN201
            calls.append(1)
            return super().batch_generate(*args, **kw)

    with RolloutClient(server.grpc_address) as real:
        with pytest.raises(RolloutError, match="UNAVAILABLE"):
            collect_retrying(_prompts(1), [Counting(real, dies)], Recorder(), 1, sampling_params(4, 1.0, 1.0), 0,
                             retries=1, wait_s=10)
    assert len(calls) == 2


def test_a_draining_replica_is_waited_for_like_a_dead_one():
    """A replica still alive but draining (its server restarts it: it takes no new samples) is not serving: the
    retry waits for it, and once the wait is spent names it "draining", as the redo would have gone to a server that
    cannot run it. Real gRPC: a rollout front whose status says so."""
    from concurrent import futures

    import grpc

    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    class Draining(rollout_pb2_grpc.RolloutServicer):
        def GetStatus(self, request, context):  # noqa: ANN001, N802
            return rollout_pb2.RolloutStatus(replicas=[
                rollout_pb2.ReplicaStatus(replica_id=0, alive=True, state=common_pb2.REPLICA_STATE_DRAINING),
                rollout_pb2.ReplicaStatus(replica_id=1, alive=True)])

    front = grpc.server(futures.ThreadPoolExecutor(2))
    rollout_pb2_grpc.add_RolloutServicer_to_server(Draining(), front)
    address = f"127.0.0.1:{front.add_insecure_port('127.0.0.1:0')}"
    front.start()
    try:
        with RolloutClient(address) as client, pytest.raises(RolloutError) as e:
            wait_serving([client], 0.5)
    finally:
        front.stop(0)
    assert f"{address}: replica 0 draining" in str(e.value) and "replica 1" not in str(e.value), str(e.value)


def test_the_rollouts_spec_totals_sum_the_completions_and_name_the_newest_drafter(server):
    """The step's SD figures: verify steps, accepted and response tokens summed over the completions, and the
    drafter version the newest of theirs (a drafter pushed mid-rollout: earlier completions carry the older one)."""
    from tlt.services.rollout.client import RolloutClient

    def stamped(c):  # noqa: ANN001, ANN202 - what a rollout speculating with drafters 2 and then 3 stamps
        c.versions.drafter = 3 if (c.prompt_index, c.sample_index) == (1, 0) else 2
        c.spec.verify_steps, c.spec.accepted_tokens, c.spec.plain_decode_steps = 2, 5, 1
        return c

    with RolloutClient(server.grpc_address) as real:
        res = collect(_prompts(2), [_Edited(real, stamped)], Recorder(), n=2, params=sampling_params(6, 1.0, 1.0),
                      step=0)
    spec = res.spec
    assert (spec.verify_steps, spec.accepted_tokens, spec.plain_steps, spec.drafter_version) == (8, 20, 4, 3)
    assert spec.response_tokens == sum(len(s.response_ids) for s in res.samples)
    assert spec.response_tokens != sum(len(s.prompt_ids) for s in res.samples)


def test_a_response_cut_at_max_tokens_is_marked_length(server):
    """The rollout's finish reason reaches the step: a response cut at max_tokens is "length" (overlong_filter
    leaves it out of the loss, truncated_fraction counts it); read as "stop", every cut response trained as whole."""
    from tlt.services.rollout.client import RolloutClient

    with RolloutClient(server.grpc_address) as client:
        res = collect(_prompts(2), [client], Recorder(), n=4, params=sampling_params(3, 1.0, 1.0, seed=4), step=0)
    reasons = {s.finish_reason for s in res.samples}
    assert "length" in reasons and reasons <= {"stop", "length"}, reasons
    assert all(len(s.response_ids) == 3 for s in res.samples if s.finish_reason == "length")
