"""Who has borrowed the replicas' devices (colocated placement), and until when.

    trainer --LendDevices(lend, lease_s)--> rollout: DeviceLease.grant      replicas publish LENT when idle
    the replicas have released                     -> start_clock            lease_s from now
    lease_s passes with no renewal                 -> on_lapse (taken back)  a crashed trainer frees them
    new work / a policy push / LendDevices(false)  -> DeviceLease.end        replicas resume, then IDLE (or BUSY)

On one GPU (or the CPU's shared cores) the rollout's replicas and the policy trainer take turns on the same
device. Without a lend, a replica that finished the rollout says IDLE, and a drafter worker starts training on
a device the trainer is about to use for its old-logprob pass and update: two trainers on one device, each
slower, and on a GPU short of memory. While lent, an idle replica says LENT instead, and drafter workers, which
train only on IDLE, stay off; the backend also releases what it can (SGLang: its KV cache).

The lease lapses by itself (`on_lapse`, on the event loop) so that a trainer killed mid-update cannot keep the
devices from the drafter forever. Its clock starts once the replicas have released (`start_clock`), not at the
grant: LendDevices waits for the release (SGLang's takes seconds), and a lease clocked from the grant lapsed
inside the very call that granted it when the release took longer, answering lent=False. Lives on the pool's
asyncio loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

MAX_LEASE_S = 86400.0  # a day: a lend is renewed well within it; a longer one is a mistake, not a plan


class DeviceLease:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_lapse: Callable[[], None]) -> None:
        self._loop = loop
        self._on_lapse = on_lapse
        self.holder = ""
        self.lease_s = 0.0
        self._deadline = 0.0  # time.monotonic() at which it lapses, once its clock runs
        self._timer: asyncio.TimerHandle | None = None
        # replica -> the command id of its latest resume, until it answers: the lend is over but that device is
        # not back yet (SGLang re-allocates its KV cache), so the replica still says LENT, not IDLE
        self.resuming: dict[Any, int] = {}

    @property
    def lent(self) -> bool:
        return bool(self.holder)

    def expires_in(self) -> float:
        """Seconds left; the whole lease while its clock has not started (the replicas still release)."""
        if not self.lent:
            return 0.0
        return max(0.0, self._deadline - time.monotonic()) if self._timer is not None else self.lease_s

    def grant(self, holder: str, lease_s: float) -> bool:
        """Lend to `holder` for `lease_s` seconds, or renew. True when the devices were not lent before: the caller
        starts the clock (`start_clock`) once the replicas have released. A renewal runs lease_s from now, or, while
        the first lend's replicas still release, from when they have."""
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        fresh = not self.lent
        self.holder = holder or "trainer"
        self.lease_s = lease_s
        if fresh:
            self._stop_clock()
        elif self._timer is not None:  # running: the renewal runs from now; not yet (the first lend's replicas still
            self.start_clock()  # release): that lend starts it once they have, as the renewal's caller waits for
        return fresh

    def start_clock(self) -> None:
        """The lease lapses `lease_s` from now unless renewed (nothing to do once it has ended)."""
        if not self.lent:
            return
        self._stop_clock()
        self._deadline = time.monotonic() + self.lease_s
        self._timer = self._loop.call_later(self.lease_s, self._lapse)

    def end(self) -> str:
        """Take the devices back; returns who had them ("" when nobody did)."""
        holder, self.holder = self.holder, ""
        self._stop_clock()
        return holder

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _lapse(self) -> None:  # a renewal or an end cancels the timer: when it fires, the lease is over
        self._timer = None
        if self.lent:
            self._on_lapse()
