"""One step's rollout: prompts -> n samples each from the rollout server(s) -> scored completions.

    PromptItem x G --split round-robin--> one BatchGenerate stream per rollout server, seeded (request_seed)
    each Completion, the moment it arrives --> reward batch.submit(...)   (scoring overlaps the tail)
    all streams done --> reward batch.results() --> ScoredCompletion x (G x n)

Seeds: with a seed in the params (the trainer's run seed: sampling_params(seed=...)),
server j's request of a step is seeded request_seed(run seed, step, j), a
function of the run alone, so a resumed run rolls each step out as the
uninterrupted run did, whatever the rollout served before, where its tokens are
a function of the seed (plain decoding; under speculative decoding, `reproducible`
requests: [trainer] reproducible_rollouts) (unseeded, the
engine drew from a per-process counter, which restarts with the server). The
rollout gives each prompt of a request its own seed derived from it
(services/rollout/engine/sequence.py prompt_seed), so the prompts' samples are
not alike. The same prompts over another number of rollout servers are other
requests: other samples.
Streams are read by one thread per server and funnelled through a queue to
this thread, which owns the reward batch (so a reward source need not be
thread-safe). An aborted completion, a failed stream or a missing reward
fails the step with a message naming the server and the prompt; a stream
that failed because a replica died is a ReplicaLostError, which the trainer
answers by rolling the step out again once the replicas are back (`collect_retrying`).
The rollout server itself first re-issues a dead replica's unfinished samples to
another replica (`[rollout] redispatch_limit`, services/rollout/replicas.py), so
the stream goes on; UNAVAILABLE reaches the trainer only when it cannot.
Whatever fails, the step's other streams are cancelled (their servers stop
generating for it), and so are its reward calls, queued or sent (a reward server skips an item it has not begun).
Under weight_sync.VersionGuard (EXPECTED_VERSION set) a completion of another policy version fails the rollout as it
arrives, before it is scored (StaleWeightsError): a stale rollout is dropped at once, not once it is scored whole.
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

import grpc

from tlt.services.trainer.dynamic_sampling import Selection
from tlt.services.trainer.rewards import RewardBatch, RewardSource
from tlt.services.trainer.types import PromptItem, ScoredCompletion
from tlt.v1 import rollout_pb2

_FINISH = {rollout_pb2.FINISH_REASON_STOP: "stop", rollout_pb2.FINISH_REASON_LENGTH: "length",
           rollout_pb2.FINISH_REASON_ABORT: "abort"}
_END = object()


class RolloutError(RuntimeError):
    """The rollout server failed to produce a completion of this step."""


class RetryableRolloutError(RolloutError):
    """A failure that rolling the step out again can mend (`collect_retrying`)."""


class ReplicaLostError(RetryableRolloutError):
    """A rollout server answered UNAVAILABLE: a replica died mid-step and its samples could not be re-dispatched
    (the server restarts it), or the server is shutting down."""


class RolloutBusyError(RetryableRolloutError):
    """A rollout server answered RESOURCE_EXHAUSTED: other clients' requests fill it (its `max_pending_sequences`)."""


_RETRYABLE = {grpc.StatusCode.UNAVAILABLE: ReplicaLostError, grpc.StatusCode.RESOURCE_EXHAUSTED: RolloutBusyError}
# the policy version every completion of a rollout must carry, while weight_sync.VersionGuard.collect runs one (None:
# unchecked here): one of another version fails the rollout as it arrives, its streams and reward calls cancelled
EXPECTED_VERSION: ContextVar[int | None] = ContextVar("tlt_expected_policy_version", default=None)
BUSY_WAIT_S = 5.0  # first wait before a busy server is asked again; doubles per retry
POLL_MIN_S = 0.5  # the shortest status poll (`wait_serving`): the one at the deadline can still find a server serving


@dataclass(frozen=True)
class SpecTotals:
    """The completions' SpecStats summed: how much of the rollout was speculative, and how well it accepted."""

    verify_steps: int = 0
    accepted_tokens: int = 0
    plain_steps: int = 0
    drafter_version: int = -1  # newest drafter version on a completion
    response_tokens: int = 0  # tokens the completions generated: the SD share's denominator (all rounds)


@dataclass
class RolloutResult:
    samples: list[ScoredCompletion]
    # rollout_s (from the first attempt to the kept one's last completion), rollout_retry_s (the part of it spent on
    # attempts dropped and the waits before each redo), reward_tail_s (wait after the last sample)
    times: dict[str, float] = field(default_factory=dict)
    spec: SpecTotals = field(default_factory=lambda: SpecTotals())  # SD counters summed over the completions
    retries: int = 0  # attempts of this rollout dropped and redone (`collect_retrying`, weight_sync.VersionGuard)
    rounds: int = 1  # rollout rounds the step took (dynamic sampling, dynamic_sampling.py)
    selection: Selection | None = None  # what dynamic sampling kept, and the stats of everything it generated

    def redone(self, attempts: int, seconds: float) -> RolloutResult:
        """This result, the rollout's kept attempt, after `attempts` dropped ones that took `seconds` with the waits
        before each redo: counted in `retries`, and in rollout_s, of which rollout_retry_s says how much."""
        self.retries += attempts
        self.times["rollout_s"] = self.times.get("rollout_s", 0.0) + seconds
        self.times["rollout_retry_s"] = self.times.get("rollout_retry_s", 0.0) + seconds
        return self


def sampling_params(max_tokens: int, temperature: float, top_p: float,
                    seed: int | None = None, reproducible: bool = False) -> rollout_pb2.SamplingParams:
    """The rollout's sampling settings. `seed`: the run's; `collect` sends each server's request its own, derived
    from it (request_seed). None: unseeded (the rollout draws its own seeds; not reproducible). `reproducible`:
    plain decoding's tokens for those seeds whatever speculation does (SamplingParams.reproducible)."""
    # logprobs=0: the chosen token's logprob, kept for the logprob-agreement diagnostic.
    params = rollout_pb2.SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                        reproducible=reproducible)
    if seed is not None:
        params.seed = seed % 2**63  # the field is an int64; a config's seed is any integer
    return params


def training_params(cfg) -> rollout_pb2.SamplingParams:  # noqa: ANN001 - TrainerConfig
    """The sampling settings of the trainer's step rollouts: seeded by the run (sampling_seed, else seed), and
    `reproducible` as [trainer] reproducible_rollouts says."""
    from tlt.services.trainer.evaluate import sampling_seed

    return sampling_params(cfg.max_tokens, cfg.temperature, cfg.top_p, seed=sampling_seed(cfg),
                           reproducible=cfg.reproducible_rollouts)


def request_seed(run_seed: int, step: int | str, server: int) -> int:
    """The seed of the request to rollout server `server` (its place in the step's clients) of `step`'s rollout (a
    dynamic-sampling round "3.1", every eval: "eval") in a run seeded `run_seed`: a function of the run's own state,
    so a resumed step samples as it did before the restart (under speculative decoding only with `reproducible`
    requests: [trainer] reproducible_rollouts); another server, step or round gets another seed, a
    retry of the step the same one. blake2b, not hash() (salted per process), into [0, 2**63): the int64 of
    SamplingParams.seed."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{server}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def server_params(params: rollout_pb2.SamplingParams, step: int | str, server: int) -> rollout_pb2.SamplingParams:
    """`params` with the seed of `server`'s request of `step` in place of the run's (unseeded: `params`)."""
    if not params.HasField("seed"):
        return params
    own = rollout_pb2.SamplingParams()
    own.CopyFrom(params)
    own.seed = request_seed(params.seed, step, server)
    return own


def _name_prompt(details: str, prompts: Sequence[PromptItem]) -> str:
    """The server's refusal of "prompt i" (its place in this request) with the data set's item it is: "prompt 0
    has at least 8189 tokens" named no row of the file."""
    m = re.match(r"prompt (\d+)\b", details)
    if m is None or int(m[1]) >= len(prompts):
        return details
    item = prompts[int(m[1])].index
    return (f"{details} (the data set's item {item}, counting from 0: `tlt data check --data FILE` names its line "
            "and every prompt too long for the context)")


def _read(client, prompts: list[PromptItem], n: int, params, batch_id: str, out: queue.Queue,  # noqa: ANN001
          streams: list) -> None:
    """Thread body: move one server's completions into `out` (then _END, or the error)."""
    try:
        stream = client.batch_generate([p.prompt for p in prompts], n=n, params=params,
                                       references=[p.answer for p in prompts], batch_id=batch_id)
        streams.append(stream)
        for c in stream:
            out.put((client, prompts, c))
        out.put(_END)
    except grpc.RpcError as e:  # deliberate boundary: handed to the step, which fails with it
        out.put(_RETRYABLE.get(e.code(), RolloutError)(f"rollout server {client.address} failed: {e.code()} "
                                                       f"{_name_prompt(e.details() or '', prompts)}"))
    except Exception as e:  # anything else (a request that cannot be encoded): the step fails with it, never waits
        err = RolloutError(f"rollout from {client.address} failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        out.put(err)


def collect_retrying(prompts: Sequence[PromptItem], clients: Sequence, rewards: RewardSource, n: int,
                     params: rollout_pb2.SamplingParams, step: int | str, retries: int, wait_s: float,
                     seed_key: int | str | None = None) -> RolloutResult:
    """`collect`, where a replica that died mid-rollout (the server restarts it and replays the weights) costs a
    redo, not the run: up to `retries` times the partial rollout is dropped and the same prompts are rolled out
    anew (with the same seeds: the samples the step would have had where the rollout's sampling is reproducible,
    `[trainer] reproducible_rollouts` under speculation; else others of the same distribution) once every replica serves again
    (`wait_serving`). A server too busy with other clients' requests to take the step's (RESOURCE_EXHAUSTED) is
    asked again the same way, after BUSY_WAIT_S, doubling. `result.retries` says how many; its rollout_s runs from
    the first attempt, rollout_retry_s is the time until the kept one began (`RolloutResult.redone`)."""
    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.weight_sync import StaleWeightsError

    done, start = 0, time.perf_counter()
    while True:
        attempt = time.perf_counter() if done else start
        try:
            return collect(prompts, clients, rewards, n, params, step, seed_key).redone(done, attempt - start)
        except StaleWeightsError as e:  # a stale completion (EXPECTED_VERSION): VersionGuard drops the rollout
            e.retries = done  # and counts the attempts of it redone here too
            raise
        except RetryableRolloutError as e:
            if done >= retries:
                raise
            done += 1
            get_logger("trainer").warning("rollout_retry", step=step, attempt=done, error=str(e)[:300])
            if isinstance(e, RolloutBusyError):
                time.sleep(min(wait_s, BUSY_WAIT_S * 2 ** (done - 1)))
            else:
                wait_serving(clients, wait_s)


def wait_serving(clients: Sequence, timeout_s: float) -> None:
    """Until every replica of every rollout server is alive and not draining (a restarted one is marked alive only
    once the latest weights are replayed into it); RolloutError after `timeout_s`, naming each server that was not
    serving and why (its last answer: the gRPC error, or which replicas were down or draining)."""
    deadline = time.monotonic() + timeout_s
    while True:
        # every server each round, each poll bounded by the time left: a front that accepts the call and never
        # answers (the trainer's clients have no deadline) ends its poll, not the wait
        not_serving = {c.address: why for c in clients
                       if (why := _not_serving(c, max(deadline - time.monotonic(), POLL_MIN_S)))}
        if not not_serving:
            return
        if time.monotonic() > deadline:
            raise RolloutError(f"the rollout replicas did not all serve again within {timeout_s}s of a replica death: "
                               + "; ".join(f"{address}: {why}" for address, why in not_serving.items())
                               + "; start the servers that are down, or see their log (replica_restart_failed?)")
        time.sleep(0.5)


def _not_serving(client, timeout_s: float) -> str:  # noqa: ANN001 - RolloutClient
    """Why `client`'s server does not serve every replica now ("" when it does)."""
    from tlt.v1 import common_pb2

    try:
        st = _status(client, timeout_s)
    except grpc.RpcError as e:  # the server itself is down or restarting: asked again until the deadline
        return f"{e.code()} {e.details()}"
    if not st.replicas:
        return "no replicas"
    down = [f"replica {r.replica_id} {'draining' if r.alive else 'not alive'}" for r in st.replicas
            if not r.alive or r.state == common_pb2.REPLICA_STATE_DRAINING]
    return ", ".join(down)


def _status(client, timeout_s: float) -> rollout_pb2.RolloutStatus:  # noqa: ANN001 - RolloutClient
    """The server's GetStatus within `timeout_s` (RolloutClient.status() takes the client's deadline: none for the
    trainer's). A client without a stub (a wrapper of one) is asked through its status()."""
    stub = getattr(client, "stub", None)
    if stub is None:
        return client.status()
    return stub.GetStatus(rollout_pb2.StatusRequest(), timeout=timeout_s)


def collect(
    prompts: Sequence[PromptItem],
    clients: Sequence,  # RolloutClient
    rewards: RewardSource,
    n: int,
    params: rollout_pb2.SamplingParams,
    step: int | str,
    seed_key: int | str | None = None,
) -> RolloutResult:
    """Roll `prompts` out over `clients` (n samples each), scoring completions as they arrive. A seeded `params`
    gives each server's request the seed of (`seed_key`, else `step`; the server's place): see request_seed."""
    t0 = time.perf_counter()
    shards = [(client, list(prompts[j :: len(clients)])) for j, client in enumerate(clients)]
    # Shard j holds prompts j, j + C, ...: its prompt i is global prompt j + i * C. By position, not by
    # object: the sampler can hand the same PromptItem twice in one step (an epoch ends mid-batch).
    global_index = {id(ps): list(range(j, len(prompts), len(clients))) for j, (_, ps) in enumerate(shards)}
    shards = [(c, ps) for c, ps in shards if ps]  # empty ones are the last: j stays the server's place
    q: queue.Queue = queue.Queue()
    streams: list = []  # the servers' BatchGenerate calls, cancelled if the step fails
    key = step if seed_key is None else seed_key
    threads = [threading.Thread(target=_read, args=(c, ps, n, server_params(params, key, j), f"step{step}-s{j}", q,
                                                    streams), daemon=True)
               for j, (c, ps) in enumerate(shards)]
    batch = rewards.begin()
    for t in threads:
        t.start()
    try:
        return _gather(prompts, batch, n, step, q, len(threads), global_index, t0)
    except BaseException:
        for st in list(streams):
            st.cancel()
        # the step's partial rollout is dropped (a retry rolls it out anew): its reward calls, queued or sent, would
        # score completions nobody uses, ahead of the retry's in the reward client's queue and the server's
        batch.cancel()
        raise


def _gather(prompts: Sequence[PromptItem], batch: RewardBatch, n: int, step: int | str, q: queue.Queue,
            left: int, global_index: dict[int, list[int]], t0: float) -> RolloutResult:
    """Read every stream's completions off `q`, scoring each as it arrives; then the step's scored samples."""
    pending: dict[str, tuple[int, rollout_pb2.Completion]] = {}
    last_arrival = t0
    expected = EXPECTED_VERSION.get()
    while left:
        item = q.get()
        if item is _END:
            left -= 1
            continue
        if isinstance(item, Exception):
            raise item
        client, shard, c = item
        if c.finish_reason == rollout_pb2.FINISH_REASON_ABORT or c.error:
            raise RolloutError(f"rollout server {client.address} aborted prompt {c.prompt_index} sample "
                               f"{c.sample_index}: {c.error or 'no reason given'}")
        if expected is not None and c.versions.policy != expected:  # stale: dropped before any of it is scored
            from tlt.services.trainer.weight_sync import check_versions

            check_versions([c.versions.policy], expected)
        prompt = shard[c.prompt_index]
        g = global_index[id(shard)][c.prompt_index]
        key = f"{step}-{g}-{c.sample_index}"
        if key in pending:
            raise RolloutError(f"rollout server {client.address} sent prompt {g} sample {c.sample_index} twice")
        pending[key] = (g, c)
        batch.submit(key, prompt.prompt, c.text, prompt.answer, extra=prompt.extra, messages=prompt.messages,
                     completion_ids=tuple(c.token_ids))
        last_arrival = time.perf_counter()
    if len(pending) != len(prompts) * n:
        raise RolloutError(f"rollout returned {len(pending)} completions, expected {len(prompts) * n}")
    scored = batch.results()
    t_end = time.perf_counter()
    samples = []
    for key, (g, c) in pending.items():
        r = scored[key]
        samples.append(ScoredCompletion(
            prompt_index=g, sample_index=c.sample_index, prompt_ids=tuple(c.prompt_token_ids),
            response_ids=tuple(c.token_ids), reward=r.reward, correct=r.correct,
            rollout_logprobs=tuple(c.logprobs) if len(c.logprobs) == len(c.token_ids) else None,
            policy_version=c.versions.policy, finish_reason=_FINISH.get(c.finish_reason, "stop"), text=c.text,
        ))
    done = [c for _, c in pending.values()]
    spec = SpecTotals(sum(c.spec.verify_steps for c in done), sum(c.spec.accepted_tokens for c in done),
                      sum(c.spec.plain_decode_steps for c in done), max((c.versions.drafter for c in done), default=-1),
                      sum(len(c.token_ids) for c in done))
    return RolloutResult(samples, {"rollout_s": last_arrival - t0, "reward_tail_s": t_end - last_arrival}, spec)
