"""RolloutIdle: the coordinator's view of whether every replica is idle, from real capacity events over ZeroMQ
on 127.0.0.1 (a real CapacityPublisher, the subscriber the workers use)."""

from __future__ import annotations

import time

from tlt.services.common.events import CapacityEvent, CapacityPublisher
from tlt.services.drafter.rollout_idle import RolloutIdle
from tlt.v1 import common_pb2

IDLE, BUSY = common_pb2.REPLICA_STATE_IDLE, common_pb2.REPLICA_STATE_BUSY


def _until(cond, timeout_s: float = 5.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_idle_only_while_every_replica_is_idle():
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.1)
    try:
        for r in (0, 1):
            pub.publish(CapacityEvent(replica_id=r, state=IDLE))
        watch = RolloutIdle(pub.pub_endpoint, pub.snapshot_endpoint)  # joins late: the snapshot gives both
        try:
            assert _until(watch.idle)
            pub.publish(CapacityEvent(replica_id=1, state=BUSY))  # one replica decodes: not idle
            assert _until(watch.busy)
            pub.publish(CapacityEvent(replica_id=0, state=BUSY))
            pub.publish(CapacityEvent(replica_id=1, state=IDLE))  # replica 0 still busy
            time.sleep(0.3)
            assert watch.busy()
            pub.publish(CapacityEvent(replica_id=0, state=IDLE))
            assert _until(watch.idle)
        finally:
            watch.close()
    finally:
        pub.close()


def test_a_silent_feed_is_not_idle_and_no_feed_configured_is():
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.1)
    pub.publish(CapacityEvent(replica_id=0, state=IDLE))
    watch = RolloutIdle(pub.pub_endpoint, pub.snapshot_endpoint, stale_s=0.5)
    try:
        assert _until(watch.idle)
        pub.close()  # the publisher dies with its replicas idle: heartbeats stop
        assert _until(watch.busy, timeout_s=3.0)  # last states no longer trusted
    finally:
        watch.close()
    assert RolloutIdle("", "").idle()  # nothing to watch: the coordinator works whenever it likes


def test_a_restarted_rollout_is_not_held_back_by_its_predecessor():
    """A rollout server restarted on the same endpoints has a new server_id: the dead one's last states
    (BUSY, DRAINING) stop counting once they are stale, instead of keeping the gate shut for good."""
    old = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", server_id="rollout-old", heartbeat_s=0.1)
    pub_ep, snap_ep = old.pub_endpoint, old.snapshot_endpoint
    old.publish(CapacityEvent(replica_id=0, state=BUSY))
    watch = RolloutIdle(pub_ep, snap_ep, stale_s=0.5)
    try:
        assert _until(lambda: watch._states) and watch.busy()
        old.close()  # the rollout dies busy
        new = CapacityPublisher(pub_ep, snap_ep, server_id="rollout-new", heartbeat_s=0.1)
        try:
            new.publish(CapacityEvent(replica_id=0, state=IDLE))
            assert _until(watch.idle, timeout_s=4.0)
            new.publish(CapacityEvent(replica_id=0, state=BUSY))
            assert _until(watch.busy)
        finally:
            new.close()
    finally:
        watch.close()


def test_a_gpu_lent_to_the_trainer_lets_the_cpu_evaluation_run_a_lent_cpu_does_not():
    """Colocated: while the trainer has the devices the replicas say LENT. The coordinator evaluates on its CPU, so
    a LENT GPU replica does not hold the gate (else a one-GPU box never publishes); a LENT CPU replica does (the
    trainer computes on those cores)."""
    lent = common_pb2.REPLICA_STATE_LENT
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.1)
    try:
        watch = RolloutIdle(pub.pub_endpoint, pub.snapshot_endpoint)
        try:
            pub.publish(CapacityEvent(replica_id=0, state=lent, device="cuda:0"))
            assert _until(watch.idle)
            pub.publish(CapacityEvent(replica_id=0, state=lent, device="cpu"))
            assert _until(watch.busy)
            pub.publish(CapacityEvent(replica_id=0, state=lent, device=""))  # unknown: taken for a CPU
            time.sleep(0.3)
            assert watch.busy()
            pub.publish(CapacityEvent(replica_id=0, state=IDLE, device="cpu"))
            assert _until(watch.idle)
        finally:
            watch.close()
    finally:
        pub.close()


def test_a_heartbeat_slower_than_the_staleness_rule_allows_is_refused() -> None:
    # A state not repeated for STALE_S (5 s) counts as busy: with heartbeats every 6 s a live, idle rollout went
    # stale between two heartbeats and every training window ended with capacity_feed_silent.
    import pytest

    from tlt.services.common.config import ConfigError, cli_overrides, load_config
    from tlt.services.common.events import STALE_S
    from tlt.services.rollout.config import RolloutConfig

    assert load_config(RolloutConfig, "rollout", environ={}).capacity_heartbeat_s * 2 <= STALE_S
    with pytest.raises(ConfigError, match="busy"):
        load_config(RolloutConfig, "rollout", overrides=cli_overrides(["capacity_heartbeat_s=6"]), environ={})
    ok = load_config(RolloutConfig, "rollout", overrides=cli_overrides(["capacity_heartbeat_s=2.5"]), environ={})
    assert ok.capacity_heartbeat_s == 2.5


def test_a_replica_dead_for_good_does_not_shut_the_gate_but_one_still_finishing_work_does():
    """A replica that died and is not restarted (max_restarts used up) says DRAINING for good (heartbeats repeat it):
    the gate needed every replica IDLE, so the coordinator never evaluated or published again although the live
    replicas sat idle. A dead replica (its counts cleared) computes nothing and is left out; a DRAINING replica still
    finishing sequences (its server stopping) counts as busy, and a rollout with no live IDLE replica is not idle."""
    from tlt.services.drafter.rollout_idle import fresh_all_idle

    draining = common_pb2.REPLICA_STATE_DRAINING
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.1)
    try:
        watch = RolloutIdle(pub.pub_endpoint, pub.snapshot_endpoint)
        try:
            pub.publish(CapacityEvent(replica_id=0, state=IDLE))
            pub.publish(CapacityEvent(replica_id=1, state=draining))  # dead: running = queued = 0
            assert _until(watch.idle, timeout_s=2.0)
            pub.publish(CapacityEvent(replica_id=0, state=BUSY))  # the live replica decodes
            assert _until(watch.busy)
            pub.publish(CapacityEvent(replica_id=0, state=IDLE))
            pub.publish(CapacityEvent(replica_id=1, state=draining, running=2))  # still finishing its sequences
            time.sleep(0.3)
            assert watch.busy()
            pub.publish(CapacityEvent(replica_id=1, state=draining))
            pub.publish(CapacityEvent(replica_id=0, state=draining))  # nothing live left: not idle
            time.sleep(0.3)
            assert watch.busy()
        finally:
            watch.close()
    finally:
        pub.close()
    now = time.monotonic()  # the workers' train_when = rollout_idle gate, from their raw states
    assert fresh_all_idle({("a", 0): (IDLE, now), ("a", 1): (draining, now)}, now, 5.0)
    assert not fresh_all_idle({("a", 0): (draining, now), ("a", 1): (draining, now)}, now, 5.0)
    assert not fresh_all_idle({("a", 0): (BUSY, now), ("a", 1): (draining, now)}, now, 5.0)


def test_while_busy_events_are_read_in_batches_and_a_busy_while_idle_at_once(monkeypatch):
    """While the rollout decodes its replicas publish tens of events a second, and nothing waits on each: the watcher
    reads what queued every BUSY_POLL_S instead of waking per event (`see` is called in bursts), and learns of the
    idle rollout at most about that much later. While the rollout is idle a BUSY must stop the coordinator's
    evaluation: it is read as it comes."""
    from statistics import median

    from tlt.services.drafter import rollout_idle

    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=1.0)
    seen: list[tuple[float, int]] = []
    orig = RolloutIdle.see

    def see(self, server_id, replica_id, state, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((time.monotonic(), state))
        return orig(self, server_id, replica_id, state, *a, **kw)

    monkeypatch.setattr(RolloutIdle, "see", see)
    try:
        for r in (0, 1):
            pub.publish(CapacityEvent(replica_id=r, state=BUSY))
        watch = RolloutIdle(pub.pub_endpoint, pub.snapshot_endpoint)
        try:
            assert _until(lambda: len(seen) >= 2) and watch.busy()
            time.sleep(0.2)
            seen.clear()
            t0 = time.monotonic()
            for i in range(40):  # count events of a decoding replica, 15 ms apart
                pub.publish(CapacityEvent(replica_id=i % 2, state=BUSY, running=i))
                time.sleep(0.015)
            assert _until(lambda: len(seen) >= 40)
            elapsed = time.monotonic() - t0
            times = [t for t, _ in seen]
            bursts = 1 + sum(b - a > 0.008 for a, b in zip(times, times[1:]))
            # one read every 50 ms: ~elapsed / 50 ms bursts, not 40 wake-ups
            assert bursts <= elapsed / rollout_idle.BUSY_POLL_S + 4, (bursts, elapsed)
            pub.publish(CapacityEvent(replica_id=0, state=IDLE))
            t0 = time.monotonic()
            pub.publish(CapacityEvent(replica_id=1, state=IDLE))
            assert _until(watch.idle)
            assert time.monotonic() - t0 < rollout_idle.BUSY_POLL_S + 0.5
            delays = []
            for _ in range(5):  # idle: each BUSY read as it comes (read every 50 ms, their median would be ~25 ms)
                time.sleep(0.1)
                seen.clear()
                t0 = time.monotonic()
                pub.publish(CapacityEvent(replica_id=1, state=BUSY))
                assert _until(lambda: any(st == BUSY for _, st in seen))
                delays.append(next(t for t, st in seen if st == BUSY) - t0)
                pub.publish(CapacityEvent(replica_id=1, state=IDLE))
                assert _until(watch.idle)
            assert median(delays) < rollout_idle.BUSY_POLL_S / 4, delays
        finally:
            watch.close()
    finally:
        pub.close()


def test_the_drafter_behind_is_the_oldest_a_live_replica_serves_and_only_versioned_ones_count():
    """What `drafter_behind` and `start_drafters` tell the coordinator's re-push (coordinator_gate.py), from real
    events: a rollout whose events carry no versions (it does not say) is never behind; one replica restarted alone
    by the pool (its start drafter, v0) while the other serves v5 is behind at v0 (the oldest, not the newest), and
    only that replica's start drafter counts; a replica that died (DRAINING) no longer counts, and one DRAINING with
    sequences only queued on it is still busy."""
    draining = common_pb2.REPLICA_STATE_DRAINING

    def serves(v: int) -> common_pb2.WeightVersions:
        return common_pb2.WeightVersions(policy=0, drafter=v)

    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.1)
    try:
        watch = RolloutIdle(pub.pub_endpoint, pub.snapshot_endpoint)
        try:
            for r in (0, 1):
                pub.publish(CapacityEvent(replica_id=r, state=IDLE))  # no versions
            assert _until(watch.idle)
            time.sleep(0.3)  # a few heartbeats
            assert watch.drafter_behind(5) is None and watch.start_drafters(5) == set()
            pub.publish(CapacityEvent(replica_id=0, state=IDLE, versions=serves(0), start_drafter="sha256:init"))
            pub.publish(CapacityEvent(replica_id=1, state=IDLE, versions=serves(5), start_drafter="sha256:other"))
            assert _until(lambda: watch.drafter_behind(5) == 0), watch.drafter_behind(5)
            assert watch.start_drafters(5) == {"sha256:init"}
            pub.publish(CapacityEvent(replica_id=0, state=draining, versions=serves(0)))  # died: left out
            assert _until(lambda: watch.drafter_behind(5) is None), watch.drafter_behind(5)
            assert watch.idle()
            pub.publish(CapacityEvent(replica_id=0, state=draining, queued=2, versions=serves(0)))  # stopping
            assert _until(watch.busy)
        finally:
            watch.close()
    finally:
        pub.close()
