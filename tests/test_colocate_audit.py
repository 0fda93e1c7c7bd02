"""DeviceLoan (services/trainer/colocate.py) against scripted rollout clients: what the colocated trainer does when
some rollout servers lend and others do not, how often it renews its lease and for whom, what it reports, and
what reaches every server when it gives the devices back. tests/test_colocated_lend.py runs the loan against
real servers with one client each; these cases need several servers that answer differently, or a renewal caught
in flight, which a real server cannot be made to do on cue. Each case is fast (no server, no model).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from rollout_helpers import ReplicaDied, RpcFailure
from tlt.services.trainer.colocate import DeviceLoan, LendError


class FakeRollout:
    """A rollout client that records each LendDevices call (time, lend, lease_s, holder) and answers as told:
    `lent` is the list of answers to successive lends (the last one repeats), `lend_error` / `renew_error` /
    `back_error` an RpcError raised by the first lend, by every later lend (the renewals) or by a give-back,
    `delay_s` the time each call takes (the replicas' release or resume)."""

    def __init__(self, address: str, lent: tuple[bool, ...] = (True,), lend_error: Exception | None = None,
                 renew_error: Exception | None = None, back_error: Exception | None = None,
                 delay_s: float = 0.0) -> None:
        self.address, self.lent, self.delay_s = address, list(lent), delay_s
        self.lend_error, self.renew_error, self.back_error = lend_error, renew_error, back_error
        self.calls: list[tuple[float, bool, float, str]] = []
        self.lock = threading.Lock()

    def lend_devices(self, lend: bool, lease_s: float = 0.0, holder: str = "trainer") -> SimpleNamespace:
        with self.lock:
            first = not any(c[1] for c in self.calls)
            self.calls.append((time.monotonic(), lend, lease_s, holder))
        time.sleep(self.delay_s)
        if not lend:
            if self.back_error is not None:
                raise self.back_error
            return SimpleNamespace(lent=False)
        if first and self.lend_error is not None:
            raise self.lend_error
        if not first and self.renew_error is not None:
            raise self.renew_error
        return SimpleNamespace(lent=self.lent.pop(0) if len(self.lent) > 1 else self.lent[0])

    def lends(self) -> list[tuple[float, bool, float, str]]:
        return [c for c in self.calls if c[1]]


def test_a_lend_taken_back_twice_gives_back_the_servers_already_lent() -> None:
    """Server a lends; server b's rollout takes the devices back before lending them, twice (other work reached
    it). borrow() raises, and a must be told to take its devices back: otherwise a's replicas stay LENT, and its
    drafter workers off, until the lease lapses, with no trainer computing on them (audit K-3)."""
    a, b = FakeRollout("a:1"), FakeRollout("b:1", lent=(False,))
    loan = DeviceLoan([a, b], lease_s=30)
    with pytest.raises(LendError, match="rollout server b:1 took the devices back before it lent them, twice"):
        loan.borrow()
    assert [c[1] for c in a.calls] == [True, False]  # lent, then given back
    assert [c[1] for c in b.calls] == [True, True, False]  # two tries, then the give-back to every server
    assert not loan.held


@pytest.mark.parametrize("code, details, hint", [
    (grpc.StatusCode.UNIMPLEMENTED, "Method not found!", True),
    (grpc.StatusCode.UNAVAILABLE, "connection refused", False),
])
def test_a_refused_lend_names_the_server_and_hints_only_for_a_server_without_lend_devices(code, details,
                                                                                         hint) -> None:
    """A rollout server that does not implement LendDevices (UNIMPLEMENTED: an older server, or one that cannot
    lend) gets the hint to turn lend_rollout_devices off; any other failure (a server down) must not be
    blamed on the setting, since turning it off would not help (audit K-6, K-7)."""
    bad = FakeRollout("b:2", lend_error=RpcFailure(code, details))
    with pytest.raises(LendError) as e:
        DeviceLoan([bad], lease_s=30).borrow()
    msg = str(e.value)
    assert msg.startswith(f"rollout server b:2 did not lend its devices: {code.name} {details}")
    assert ("set [trainer] lend_rollout_devices = false" in msg) is hint


def test_borrow_and_give_back_report_the_seconds_the_servers_took() -> None:
    """The trainer's step breakdown (metrics.jsonl times.lend_s, the report's 'device lend' row) adds what
    borrow() and give_back() return: the time the replicas took to release and to resume. Two servers taking
    0.15 s a call, called one after the other, take at least 0.3 s each way; a loan that answered 0 would hide
    the lend's cost from the report (audit K-9, K-25)."""
    servers = [FakeRollout("a:3", delay_s=0.15), FakeRollout("b:3", delay_s=0.15)]
    loan = DeviceLoan(servers, lease_s=30)
    took = loan.borrow()
    assert 0.3 <= took < 1.5
    back = loan.give_back()
    assert 0.3 <= back < 1.5


def test_every_lend_and_renewal_carries_the_holder() -> None:
    """The rollout reports who holds its devices (GetStatus lent_to) from the holder each LendDevices names: the
    first lend and every renewal must name the loan's holder, and the holder is 'trainer' unless told (audit K-12,
    K-15, K-28)."""
    s = FakeRollout("a:4")
    loan = DeviceLoan([s], lease_s=0.3, holder="trainer-7")
    loan.borrow()
    time.sleep(0.35)  # about three renewals
    loan.give_back()
    lends = s.lends()
    assert len(lends) >= 2 and all(c[3] == "trainer-7" and c[2] == 0.3 for c in lends), lends

    s = FakeRollout("a:5")
    loan = DeviceLoan([s], lease_s=30)
    loan.borrow()
    loan.give_back()
    assert [c[3] for c in s.lends()] == ["trainer"]


def test_the_lease_is_renewed_every_third_of_it() -> None:
    """The renewer lends again every lease_s / 3, so a slow renewal still lands before the lease lapses (two more
    thirds to spare). With lease_s 0.6 that is every 0.2 s: over 1 s, at least 3 renewals and no gap between
    lends of 0.4 s or more; renewing once per lease_s would leave the lease to lapse at each renewal's edge and
    the replicas to say IDLE mid-update (audit K-13, K-14)."""
    s = FakeRollout("a:6")
    loan = DeviceLoan([s], lease_s=0.6)
    loan.borrow()
    time.sleep(1.0)
    loan.give_back()
    times = [c[0] for c in s.lends()]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(times) >= 4 and max(gaps) < 0.4, gaps


def test_a_failed_renewal_keeps_renewing_every_server() -> None:
    """A renewal that fails on one server (a blip; the lease has two more thirds) must not stop the renewals: not
    of the other servers in the same round, nor of any server in later rounds. Server a fails every renewal,
    server b must still be renewed about every 0.1 s, and a tried again each round (audit K-16, K-17, K-18)."""
    a = FakeRollout("a:7", renew_error=ReplicaDied())
    b = FakeRollout("b:7")
    loan = DeviceLoan([a, b], lease_s=0.3)
    loan.borrow()
    time.sleep(0.45)  # about four renewal rounds
    loan.give_back()
    assert len(a.lends()) >= 3 and len(b.lends()) >= 3, (a.lends(), b.lends())
    assert [c[1] for c in b.calls][-1] is False


def test_give_back_waits_for_a_renewal_in_flight() -> None:
    """A renewal that is still on its way when the trainer gives back must not land after the give-back: the
    server would be lent again (its replicas LENT, the drafter off) for a whole lease while the trainer pushes
    weights and rolls out. give_back() stops the renewer and waits for it before it takes the devices back, so
    the server's last call is the give-back (audit K-20)."""
    renewing, release = threading.Event(), threading.Event()

    class SlowRenewal(FakeRollout):
        def lend_devices(self, lend: bool, lease_s: float = 0.0, holder: str = "trainer") -> SimpleNamespace:
            if lend and self.lends():  # a renewal: wait until the test lets it through
                renewing.set()
                release.wait(5)
            return super().lend_devices(lend, lease_s, holder)

    s = SlowRenewal("a:8")
    loan = DeviceLoan([s], lease_s=0.15)
    loan.borrow()
    assert renewing.wait(5)
    back = threading.Thread(target=loan.give_back)
    back.start()
    time.sleep(0.2)
    release.set()
    back.join(5)
    assert not back.is_alive()
    assert [c[1] for c in s.calls] == [True, True, False]


def test_give_back_stops_the_renewer_at_once_not_at_its_next_renewal() -> None:
    """give_back() wakes the renewer (its stop event) and joins it: with a 30 s lease the renewer sleeps 10 s
    between renewals, and a give-back must not wait for that, nor hang when nothing wakes it (audit K-19: with the
    stop event never set, the join waited forever, and only pytest's 900 s timeout ended the run). Run in a thread
    so that a hang fails here within seconds."""
    s = FakeRollout("a:9")
    loan = DeviceLoan([s], lease_s=30)
    loan.borrow()
    renewer = loan._renewer
    back = threading.Thread(target=loan.give_back, daemon=True)
    t0 = time.monotonic()
    back.start()
    back.join(5)
    assert not back.is_alive(), "give_back() did not return within 5 s: the lease renewer was not stopped"
    assert time.monotonic() - t0 < 2 and not renewer.is_alive() and not loan.held
    assert [c[1] for c in s.calls] == [True, False]


def test_a_give_back_that_fails_on_one_server_still_reaches_the_others() -> None:
    """One rollout server that cannot be reached must not keep the others lent: give_back() tells every server,
    then raises naming the ones that failed (audit K-24)."""
    a = FakeRollout("a:9", back_error=ReplicaDied())
    b = FakeRollout("b:9")
    loan = DeviceLoan([a, b], lease_s=30)
    loan.borrow()
    with pytest.raises(LendError) as e:
        loan.give_back()
    assert str(e.value) == "rollout servers did not take their devices back: a:9: UNAVAILABLE replica 0 died"
    assert [c[1] for c in b.calls] == [True, False] and not loan.held


def test_a_failed_lend_is_reported_even_when_its_give_back_fails_too() -> None:
    """borrow() fails on server b after a lent; giving a back fails as well. The error the trainer ends with must
    be the lend's (it says which server would not lend, and why); the give-back's failure is only logged, its
    lease lapses on its own (audit K-26)."""
    a = FakeRollout("a:10", back_error=ReplicaDied())
    b = FakeRollout("b:10", lend_error=RpcFailure(grpc.StatusCode.UNAUTHENTICATED, "bad token"))
    with pytest.raises(LendError, match="^rollout server b:10 did not lend its devices: UNAUTHENTICATED bad token"):
        DeviceLoan([a, b], lease_s=30).borrow()
    assert [c[1] for c in a.calls] == [True, False]
