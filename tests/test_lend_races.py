"""LendDevices racing the traffic it lends around (a colocated trainer's lend while requests still arrive, a renewal
from a caller whose first call timed out). Real rollout server (replica process, native engine) on 127.0.0.1.

- A request handled in the loop turn after a lend put its take-back's Lend(False) on the replica's pipe ahead of the
  lend's Lend(True) (sent from tasks a turn later): the replica held the late Lend(True) until its engine was idle,
  the lend waited as long as traffic kept it busy (a 30 s deadline passed in an audit), and the replica then
  released while the pool served on it.
- A renewal sent while the first lend's replicas still decoded answered lent=True at once, and started the lease
  clock, which lapsed inside the first call.
"""

from __future__ import annotations

import asyncio
import threading
import time

from rollout_helpers import ServerThread
from tlt.services.rollout.types import GenerationRequest, SamplingParams


def _long(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, tuple(range(3, 10)), SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True), 2)


def test_a_request_in_the_turn_after_a_lend_never_queues_its_take_back_ahead_of_the_lend(random_model_dir) -> None:
    with ServerThread(random_model_dir, replicas=1, insecure_local=True) as server:
        pool = server.server.pool
        order: list[bool] = []  # Lend commands as they go on the replica's pipe
        rep = pool.replicas[0]
        put = rep.outbox.put

        def recording(cmd, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if type(cmd).__name__ == "Lend":
                order.append(cmd.lent)
            return put(cmd, *a, **kw)

        rep.outbox.put = recording

        async def race() -> tuple[float, str]:
            lend = asyncio.ensure_future(pool.lend("trainer", 60.0, 600.0))
            await asyncio.sleep(0)  # lend() has granted the lease
            stream = pool.generate(_long("r0"), want_steps=True)
            await stream.__anext__()  # the request is handed over (the take-back) before lend() runs again
            t0 = time.monotonic()
            await asyncio.wait_for(lend, 30)
            took = time.monotonic() - t0
            async for _ in stream:  # the replica keeps serving it
                pass
            return took, pool.lent_to

        took, holder = server.call(race(), timeout=120)
    assert order[:2] == [True, False], order  # the lend's release first, then the take-back's resume
    assert took < 10.0 and holder == "", (took, holder)  # answered while the request still decoded


def test_a_renewal_answers_once_the_first_lends_replicas_have_released(random_model_dir) -> None:
    from tlt.services.rollout.client import RolloutClient
    from tlt.v1 import rollout_pb2

    with ServerThread(random_model_dir, replicas=1, insecure_local=True) as server:
        addr, log, t0 = server.grpc_address, {}, time.monotonic()

        def generate() -> None:
            with RolloutClient(addr, timeout_s=120) as c:
                c.generate("1+1=", n=12, params=rollout_pb2.SamplingParams(max_tokens=240, ignore_eos=True))
            log["finished"] = time.monotonic() - t0

        def lend(tag: str) -> None:
            with RolloutClient(addr, timeout_s=120) as c:
                r = c.lend_devices(True, lease_s=0.4, holder="trainer")
            log[tag] = (time.monotonic() - t0, r.lent)

        g = threading.Thread(target=generate)
        g.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the request decodes on the replica
            with RolloutClient(addr) as c:
                if any(r.running for r in c.status().replicas):
                    break
            time.sleep(0.05)
        a = threading.Thread(target=lend, args=("first",))
        a.start()
        time.sleep(0.3)
        b = threading.Thread(target=lend, args=("renewal",))
        b.start()
        for t in (a, b, g):
            t.join(120)
    assert log["renewal"][0] >= log["finished"] - 0.5, log  # not before the replica had released (nothing running)
    assert log["first"][1] and log["renewal"][1], log  # the lease ran from the release: neither found it lapsed


def test_a_lease_counts_whole_until_its_clock_starts_and_a_renewal_runs_from_now():
    """DeviceLease on its own (lease.py), on a real event loop: granted, its clock waits for the replicas' release
    and the lease has all its lease_s left meanwhile (what a renewal sent then is answered), not 0; once running, a
    renewal runs lease_s from the renewal, not from the first start (else a lease renewed in time still lapsed)."""
    from tlt.services.rollout.lease import DeviceLease

    async def main() -> None:
        lapsed: list[bool] = []
        lease = DeviceLease(asyncio.get_running_loop(), lambda: lapsed.append(True))
        assert lease.grant("trainer", 3.0) is True
        assert lease.expires_in() == 3.0
        lease.start_clock()
        await asyncio.sleep(1.0)
        assert lease.grant("trainer", 3.0) is False  # a renewal
        assert lease.expires_in() > 2.9 and not lapsed
        assert lease.end() == "trainer" and lease.expires_in() == 0.0

    asyncio.run(main())


def test_a_running_lease_counts_down_a_holderless_lend_is_lent_and_a_zero_lease_is_refused():
    """DeviceLease on its own: once its clock runs, expires_in is what is left (LendDevices answers it as
    expires_in_s, and the trainer renews by it), not the whole lease_s for ever; a lend whose caller named no holder
    is still a lend (held by "trainer"), not one that leaves the replicas IDLE under the drafter; and lease_s 0 is
    refused here too, not a lease that lapses on the next loop turn."""
    import pytest

    from tlt.services.rollout.lease import DeviceLease

    async def main() -> None:
        lease = DeviceLease(asyncio.get_running_loop(), lambda: None)
        assert lease.grant("", 3.0) is True
        assert lease.lent and lease.holder == "trainer"
        lease.start_clock()
        t0 = time.monotonic()
        await asyncio.sleep(0.5)
        left = lease.expires_in()
        assert left <= 3.0 - (time.monotonic() - t0) + 0.05 and left <= 2.6, left
        assert lease.end() == "trainer"
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match="lease_s must be > 0"):
                lease.grant("trainer", bad)
        assert not lease.lent

    asyncio.run(main())
