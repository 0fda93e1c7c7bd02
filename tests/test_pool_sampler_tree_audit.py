"""Mutation-audit pins for the sampler (engine/sampler.py), draft trees (spec/tree.py), the GC pause counters
(common/gc_heap.py) and the pool's capacity events and lending (rollout/pool_states.py).

Each test names the mutant(s) it kills. References are hand-computed values or plain-Python recomputations;
nothing is downloaded, nothing starts a process: the pool tests drive a real `ReplicaPool` on an asyncio loop with
in-process `_Replica` stand-ins (no engine), answering its commands the way replicas.py's reader does.
"""

from __future__ import annotations

import asyncio
import gc
import math
import queue

import pytest
import torch

from tlt.services.rollout.engine.sampler import sample
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.spec.filters import filter_logits
from tlt.services.rollout.spec.tree import Arm, build_tree
from tlt.services.rollout.types import SamplingParams


def _seqs(params: list[SamplingParams], seed: int = 5) -> list[Sequence]:
    return [Sequence("a", i, (1, 2, 3), p, 4, seed, frozenset()) for i, p in enumerate(params)]


# ---- sampler ------------------------------------------------------------------------------------------------------


def test_a_temperature_above_one_flattens_the_distribution_sampled_and_reported():
    """S-12 (temperature capped at 1). logits [0, 2 ln 3] at T = 2 -> q = softmax([0, ln 3]) = [1/4, 3/4]: the
    reported logprobs are those of q (hand-computed), and 4000 independent seeded rows draw token 1 at ~3/4."""
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]])
    params = SamplingParams(temperature=2.0, logprobs=1, seed=11)
    out = sample(logits, _seqs([params]))
    q = {0: math.log(0.25), 1: math.log(0.75)}
    assert out.logprobs[0] == pytest.approx(q[out.token_ids[0]], abs=1e-5)
    assert out.top_logprobs[0] == pytest.approx({1: q[1]}, abs=1e-5)

    n = 4000
    seqs = [Sequence("s", i, (1, 2, 3), SamplingParams(temperature=2.0, seed=7), 4, 7, frozenset()) for i in range(n)]
    freq = sum(sample(logits.expand(n, 2), seqs).token_ids) / n
    assert abs(freq - 0.75) < 0.03, freq  # 4000 draws: sd 0.007; T capped at 1 gives 0.9


def test_a_sampled_rows_logprobs_are_of_its_filtered_distribution_even_beside_a_row_without_logprobs():
    """S-14 (the filtered distribution replaces the raw one only when every row asked for logprobs). Row 0 is
    sampled with top_k = 1 (q one-hot on its argmax: log q = 0) and wants logprobs; row 1 is greedy and wants none."""
    logits = torch.tensor([[3.0, 1.0, 2.5, -2.0], [0.0, 1.0, 0.0, 0.0]])
    out = sample(logits, _seqs([SamplingParams(temperature=0.8, top_k=1, seed=5, logprobs=1),
                                SamplingParams(temperature=0.0)]))
    assert out.token_ids == [0, 1]
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-6) and out.logprobs[1] is None
    assert out.top_logprobs[0] == {0: pytest.approx(0.0, abs=1e-6)}


def test_half_precision_logits_are_reported_in_float32():
    """S-1 (no float32 upcast): bf16 logits (what a bf16 model's lm_head gives) must give the log-softmax of the
    float32 values, not one computed in bf16 (errors ~1e-2)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 64, generator=g) * 4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=3)]
    out = sample(logits, _seqs(params))
    x = logits.float()
    ref = [x[0].log_softmax(-1), filter_logits(x[1:], 0.7, 0, 0.9, 0.0)[0].log_softmax(-1)]
    for r in range(2):
        assert out.logprobs[r] == pytest.approx(float(ref[r][out.token_ids[r]]), abs=1e-5)
        for tok, lp in out.top_logprobs[r].items():
            assert lp == pytest.approx(float(ref[r][tok]), abs=1e-5)
    assert out.token_ids[0] == int(x[0].argmax())


# ---- draft trees --------------------------------------------------------------------------------------------------


def test_kept_nodes_are_in_candidate_order_when_a_deeper_draft_outscores_a_shallower_one():
    """T-17 (kept nodes left in score order). Root -> tok 0 (.6), tok 1 (.15); tok 0 -> tok 2 (.9): candidate 3
    (depth 2, .54) outscores candidate 2 (depth 1, .15). Arm 2_2_4 keeps candidates 1, 2, 3 and lays them out in
    drafting order (depth never decreases along the nodes), not 1, 3, 2."""
    table = {9: [0.6, 0.15, 0.1, 0.1, 0.05], 0: [0.02, 0.01, 0.9, 0.04, 0.03], 1: [0.5, 0.3, 0.1, 0.06, 0.04]}

    def expand(step, beam, toks):  # noqa: ANN001, ANN202
        return torch.tensor([[table[int(t)] for t in row] for row in toks]).log()

    tree = build_tree(torch.tensor([9]), expand, Arm(2, 2, 4))
    assert tree.tokens.tolist() == [[9, 0, 1, 2]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1]]
    assert tree.depth.tolist() == [[0, 1, 1, 2]]
    assert torch.allclose(tree.score.exp(), torch.tensor([[1.0, 0.6, 0.15, 0.54]]))


def test_a_nan_draft_scores_below_every_real_draft_however_unlikely():
    """T-11 (NaN scored as a large finite negative). A NaN log-prob is the worst candidate (module comment): a real
    draft at log-prob -1e5 is kept before it. Arm 1_3_3 keeps 2 of the root's 3 candidates."""
    def expand(step, beam, toks):  # noqa: ANN001, ANN202
        lp = torch.full((1, 1, 6), -math.inf)
        lp[0, 0, 1], lp[0, 0, 2], lp[0, 0, 3] = -0.1, -1e5, float("nan")
        return lp

    tree = build_tree(torch.tensor([0]), expand, Arm(1, 3, 3))
    assert sorted(tree.tokens[0, 1:].tolist()) == [1, 2]
    assert sorted(tree.score[0, 1:].tolist()) == [-1e5, pytest.approx(-0.1)]


# ---- GC pauses ----------------------------------------------------------------------------------------------------


class _Clock:
    """A clock that reads the given times in turn (what GcPauses' start/stop callbacks see), then its last one."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.times[min(self.reads, len(self.times)) - 1]


def test_pauses_sum_and_max_each_collection_on_the_given_clock():
    """G-3 (seconds = last pause), G-4 (max = last pause), G-6 (a second install counts twice), G-7 (a snapshot
    aliasing the live counters), G-11 (the start phase counted as a collection), G-12 (the injected clock ignored).
    Three full collections of 1.0, 3.0 and 0.5 s on a scripted clock: 3 collections, 4.5 s, longest 3.0 s."""
    from tlt.services.common.gc_heap import GcPauses

    clock = _Clock(0.0, 1.0, 10.0, 13.0, 20.0, 20.5)
    pauses = GcPauses(clock=clock)
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection reads the scripted clock
    try:
        pauses.install().install()
        empty = pauses.snapshot()
        for _ in range(3):
            gc.collect(2)
    finally:
        pauses.uninstall()
        left = gc.callbacks.count(pauses._callback)
        while pauses._callback in gc.callbacks:  # leave no scripted clock behind for the tests that follow
            gc.callbacks.remove(pauses._callback)
        if was_enabled:
            gc.enable()
    assert left == 0, "a second install() hooked the callback twice"
    snap = pauses.snapshot()
    assert empty["collections"] == [0, 0, 0] and empty["seconds"] == [0.0, 0.0, 0.0], empty
    assert snap["collections"] == [0, 0, 3], snap
    assert snap["seconds"][2] == pytest.approx(4.5) and snap["max_seconds"][2] == pytest.approx(3.0), snap
    assert snap["seconds"][:2] == [0.0, 0.0] and clock.reads == 6


def test_every_gc_gauge_reads_its_own_field_for_every_generation():
    """G-9 (the pause-seconds gauge read from max_seconds): distinct values per field and generation."""
    from tlt.services.common.gc_heap import GcMetrics
    from tlt.services.common.metrics import Metrics

    m = Metrics("rollout")
    GcMetrics(m).update("front", {"frozen_objects": 7, "collections": [40, 3, 1], "seconds": [0.5, 0.25, 2.0],
                                  "max_seconds": [0.125, 0.0625, 1.5]})
    text = m.render().decode()
    assert 'rollout_gc_frozen_objects{process="front"} 7.0' in text
    for name, values in (("gc_collections", [40.0, 3.0, 1.0]), ("gc_pause_seconds", [0.5, 0.25, 2.0]),
                         ("gc_max_pause_seconds", [0.125, 0.0625, 1.5])):
        for g, v in enumerate(values):
            assert f'rollout_{name}{{generation="{g}",process="front"}} {v}' in text, (name, g)


# ---- the pool's capacity events and lending ------------------------------------------------------------------------


class _Sink:
    """A capacity sink (common.events.CapacitySink's publish) recording (monotonic time, event)."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:  # noqa: ANN001
        import time

        self.events.append((time.monotonic(), event))

    def states(self, replica_id: int = 0) -> list[str]:
        from tlt.v1 import common_pb2

        return [common_pb2.ReplicaState.Name(e.state).removeprefix("REPLICA_STATE_")
                for _, e in self.events if e.replica_id == replica_id]

    def last(self, replica_id: int = 0):  # noqa: ANN201
        return [e for _, e in self.events if e.replica_id == replica_id][-1]


def _pool(n: int = 1):  # noqa: ANN202 - on the running loop, as ReplicaPool.start makes it
    """A real ReplicaPool whose replicas are in-process `_Replica`s (no engine process): commands land on each
    replica's outbox, and the test answers them through the pool's `_on_event`, as replicas.py's reader does."""
    from tlt.services.rollout.replica_lifecycle import _Replica
    from tlt.services.rollout.replicas import ReplicaPool

    sink = _Sink()
    pool = ReplicaPool("(none)", "native", None, n, 1, capacity=sink)
    pool._loop = asyncio.get_running_loop()
    pool.lease = pool._new_lease()
    for i in range(n):
        rep = _Replica(i, None, None)
        rep.alive = True
        pool.replicas.append(rep)
        pool._maybe_idle(rep)  # what start() publishes once a replica is up
    return pool, sink


async def _until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    """Wait for what a timer will publish; a generous bound, so a loaded machine only makes it slower."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


def _commands(rep) -> list:  # noqa: ANN001
    out = []
    while True:
        try:
            out.append(rep.outbox.get_nowait())
        except queue.Empty:
            return out


def _answer(pool, rep, cmd, error: str = "") -> None:  # noqa: ANN001
    from tlt.services.rollout.ipc import Reply

    pool._on_event(rep, Reply(cmd.cmd_id, error))


async def _lend(pool, rep, lease_s: float = 60.0) -> dict:  # noqa: ANN001
    """Lend the one replica to "trainer": its release is answered, the lend's result returned."""
    lend = asyncio.ensure_future(pool.lend("trainer", lease_s, 5.0))
    await asyncio.sleep(0)
    (release,) = _commands(rep)
    assert release.lent is True
    _answer(pool, rep, release)
    return await asyncio.wait_for(lend, 5)


async def _answered(pool, sink, rep, cmd) -> str:  # noqa: ANN001
    """Answer `cmd` and let the pool act on it: the replica's state now."""
    _answer(pool, rep, cmd)
    await asyncio.sleep(0)
    return sink.states(rep.replica_id)[-1]


def _hand_work(pool, rep, n: int) -> None:  # noqa: ANN001
    """What ReplicaPool.generate does once it hands n sequences to `rep`: count them in, then BUSY (or a refresh)."""
    rep.outstanding += n
    pool._busy(rep)


def _drop(pool, rep, n: int, load) -> None:  # noqa: ANN001
    """The replica answers an abort of n of its sequences (ipc.Aborted) with its engine's load after it."""
    from tlt.services.rollout.ipc import Aborted

    cmd_id = 1000 + len(rep.aborting)
    rep.aborting[cmd_id] = n
    pool._on_event(rep, Aborted(cmd_id, load))


def test_counts_split_the_outstanding_sequences_into_running_and_queued():
    """P-4 (running not capped by what is outstanding), P-5 (queued = every outstanding sequence). 3 handed to a
    replica whose engine last reported 2 running: running 2, queued 1; after an abort of 2 (engine still says 2
    running, as of its last report), 1 outstanding: running 1, queued 0."""
    from tlt.services.rollout.ipc import EngineLoad

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        rep.load = EngineLoad(running=2, queued=0, kv_usage=0.25)
        _hand_work(pool, rep, 3)
        e = sink.last()
        assert sink.states() == ["IDLE", "BUSY"] and (e.running, e.queued) == (2, 1), e
        _drop(pool, rep, 2, EngineLoad(running=2, queued=0, kv_usage=0.25))
        await _until(lambda: len(sink.events) == 3)  # the coalesced refresh
        e = sink.last()
        assert sink.states() == ["IDLE", "BUSY", "BUSY"] and (e.running, e.queued) == (1, 0), e

    asyncio.run(main())


def test_count_and_kv_changes_are_republished_coalesced_at_most_every_refresh_min_s():
    """P-6 (KV use compared by tenths, not percents), P-12 (no rate limit), P-13 (a longer REFRESH_MIN_S), P-15
    (a refresh re-published when nothing changed). A busy replica's KV use moving 50% -> 53% is published once,
    REFRESH_MIN_S (0.1 s) after its BUSY, not at once nor seconds later; a count that moves and moves back
    within the window publishes nothing."""
    from tlt.services.rollout import pool_states
    from tlt.services.rollout.ipc import EngineLoad, StepEvents

    assert pool_states.REFRESH_MIN_S == 0.1

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        rep.load = EngineLoad(running=1, kv_usage=0.50)
        _hand_work(pool, rep, 1)
        t_busy = sink.events[-1][0]
        pool._on_event(rep, StepEvents([], [], EngineLoad(running=1, kv_usage=0.53)))
        await _until(lambda: len(sink.events) >= 3)
        await asyncio.sleep(0.3)  # and nothing more
        assert sink.states() == ["IDLE", "BUSY", "BUSY"], sink.states()
        t_kv, e = sink.events[-1]
        assert round(e.kv_usage, 2) == 0.53 and t_kv - t_busy >= 0.09, (e, t_kv - t_busy)
        _hand_work(pool, rep, 1)  # one more sequence handed over ...
        _drop(pool, rep, 1, EngineLoad(running=1, kv_usage=0.53))  # ... and dropped within the window
        await asyncio.sleep(0.3)
        assert sink.states() == ["IDLE", "BUSY", "BUSY"], sink.states()

    asyncio.run(main())


def test_a_drafter_push_republishes_an_idle_replicas_versions():
    """P-7 (the drafter version left out of what decides a new event): after a push the pool schedules a refresh of
    every replica (replicas.py `_apply_on`); an idle replica says IDLE again with the new drafter version."""
    from tlt.services.rollout.types import Versions

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        assert sink.last().versions.drafter == -1
        pool.versions = Versions(policy=0, drafter=3)
        pool._schedule_refresh(rep)
        await _until(lambda: len(sink.events) >= 2)
        assert sink.states() == ["IDLE", "IDLE"] and sink.last().versions.drafter == 3, sink.states()

    asyncio.run(main())


def test_a_lend_a_replica_could_not_release_for_fails_and_takes_the_devices_back():
    """P-2 (a Reply carrying an error counted a success), P-17 (a failed lend leaving the devices lent). Two
    replicas; replica 1 answers its release with an error: lend raises WeightUpdateError, the lease is over, and each
    replica is sent its resume (LENT until it answers, then IDLE)."""
    from tlt.services.rollout.errors import WeightUpdateError

    async def main() -> None:
        pool, sink = _pool(2)
        lend = asyncio.ensure_future(pool.lend("trainer", 60.0, 5.0))
        await asyncio.sleep(0)
        for rep in pool.replicas:
            (cmd,) = _commands(rep)
            assert cmd.lent is True
            _answer(pool, rep, cmd, "boom" if rep.replica_id == 1 else "")
        with pytest.raises(WeightUpdateError, match="replica 1: boom"):
            await asyncio.wait_for(lend, 5)
        assert pool.lent_to == ""
        for rep in pool.replicas:
            (cmd,) = _commands(rep)
            assert cmd.lent is False
            assert sink.states(rep.replica_id)[-1] == "LENT"  # until its resume is answered
            _answer(pool, rep, cmd)
        await asyncio.sleep(0)
        assert [sink.states(r)[-1] for r in (0, 1)] == ["IDLE", "IDLE"]

    asyncio.run(main())


def test_taking_back_what_was_never_lent_sends_nothing():
    """P-19 (take_back without a lend resumed every replica and waited for their answers)."""
    async def main() -> None:
        pool, sink = _pool()
        got = await asyncio.wait_for(pool.take_back(5.0), 1.0)
        assert got["seconds"] == 0.0 and got["replicas"] == [0]
        assert _commands(pool.replicas[0]) == [] and sink.states() == ["IDLE"]

    asyncio.run(main())


def test_a_replica_stays_lent_until_its_latest_resume_is_answered():
    """P-21 (an earlier resume's answer ending a later one's wait). Lent, taken back (resume A), lent and taken back
    again (resume B) before A is answered: A's answer leaves the replica LENT; only B's makes it IDLE."""
    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        resumes: list = []
        for _ in range(2):
            await _lend(pool, rep)
            pool._take_back_now("test")
            resumes += _commands(rep)
        assert [c.lent for c in resumes] == [False, False]
        resume_a, resume_b = resumes
        assert sink.states()[-1] == "LENT"
        assert await _answered(pool, sink, rep, resume_a) == "LENT", sink.states()
        assert await _answered(pool, sink, rep, resume_b) == "IDLE", sink.states()

    asyncio.run(main())


def test_a_take_back_that_times_out_keeps_the_replica_lent_until_it_answers():
    """P-22 (the timeout cancelling the resume: IDLE published before the replica has its device back)."""
    from tlt.services.rollout.errors import WeightUpdateError

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        await _lend(pool, rep)
        with pytest.raises(WeightUpdateError, match="taking the devices back failed"):
            await pool.take_back(0.05)
        await asyncio.sleep(0.05)
        assert sink.states()[-1] == "LENT", sink.states()
        (resume,) = _commands(rep)
        assert await _answered(pool, sink, rep, resume) == "IDLE", sink.states()

    asyncio.run(main())


def test_a_lease_nobody_renews_lapses_and_the_devices_come_back():
    """P-23 (a lapsed lease not taken back), P-24 (the lease clock never started after the release)."""
    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        got = await _lend(pool, rep, lease_s=0.2)
        assert pool.lent_to == "trainer" and 0 < got["expires_in_s"] <= 0.2
        await _until(lambda: pool.lent_to == "")
        (resume,) = _commands(rep)
        assert resume.lent is False
        assert await _answered(pool, sink, rep, resume) == "IDLE"
        assert sink.states() == ["IDLE", "LENT", "IDLE"], sink.states()

    asyncio.run(main())


def test_work_that_comes_and_goes_while_a_resume_is_on_its_way_leaves_the_replica_lent():
    """P-9 (a replica whose resume is unanswered counted IDLE). Taken back, then a request handed and finished
    before the replica answered its resume: BUSY, then LENT again (SGLang's KV cache is not back: no drafter worker
    may start on the device), IDLE only with the resume's answer."""
    from tlt.services.rollout.ipc import EngineLoad

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        await _lend(pool, rep)
        pool._take_back_now("new work")
        (resume,) = _commands(rep)
        _hand_work(pool, rep, 1)
        _drop(pool, rep, 1, EngineLoad())
        assert sink.states() == ["IDLE", "LENT", "BUSY", "LENT"], sink.states()
        assert await _answered(pool, sink, rep, resume) == "IDLE"

    asyncio.run(main())


def test_a_replica_whose_work_ends_while_the_pool_stops_stays_draining():
    """P-10 (IDLE published while the pool stops). stop() publishes DRAINING first; a sequence finishing after that
    must not say IDLE (a drafter worker would start on a device being shut down)."""
    from tlt.services.rollout.ipc import EngineLoad
    from tlt.v1 import common_pb2

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        _hand_work(pool, rep, 1)
        pool._stopping = True  # what ReplicaPool.stop does first, then DRAINING for each replica
        pool._publish_state(rep, common_pb2.REPLICA_STATE_DRAINING)
        _drop(pool, rep, 1, EngineLoad())
        await asyncio.sleep(0.3)
        assert sink.states() == ["IDLE", "BUSY", "DRAINING"], sink.states()

    asyncio.run(main())


def test_two_refresh_reasons_in_one_loop_turn_still_publish_refresh_min_s_apart():
    """P-11 (no `refresh_scheduled` flag: each reason schedules its own refresh). Two reasons to refresh in one loop
    turn, with a step event (new KV use) queued between them: one event now, the step's REFRESH_MIN_S later, not a
    second one at once."""
    from tlt.services.rollout.ipc import EngineLoad, StepEvents
    from tlt.v1 import common_pb2

    async def main() -> None:
        pool, sink = _pool()
        rep = pool.replicas[0]
        _hand_work(pool, rep, 1)
        await asyncio.sleep(0.2)  # past REFRESH_MIN_S since BUSY: the next refresh goes out in the next turn
        rep.load = EngineLoad(running=1, kv_usage=0.2)
        pool._schedule_refresh(rep)
        pool._loop.call_soon(pool._on_event, rep, StepEvents([], [], EngineLoad(running=1, kv_usage=0.4)))
        pool._schedule_refresh(rep)  # coalesced with the first

        def busy() -> list:
            return [(t, e) for t, e in sink.events if e.state == common_pb2.REPLICA_STATE_BUSY]

        await _until(lambda: len(busy()) >= 3)
        await asyncio.sleep(0.2)  # and no fourth
        busy = busy()
        assert [round(e.kv_usage, 1) for _, e in busy] == [0.0, 0.2, 0.4], busy
        assert busy[2][0] - busy[1][0] >= 0.09, busy[2][0] - busy[1][0]

    asyncio.run(main())
