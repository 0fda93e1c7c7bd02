"""Who has borrowed the replicas' devices (colocated placement), and until when.

    trainer --LendDevices(lend, lease_s)--> rollout: DeviceLease.grant      replicas publish LENT when idle
    lease_s passes with no renewal                 -> on_lapse (taken back)  a crashed trainer frees them
    new work / a policy push / LendDevices(false)  -> DeviceLease.end        replicas resume, IDLE or BUSY

On one GPU (or the CPU's shared cores) the rollout's replicas and the policy trainer take turns on the same
device. Without a lend, a replica that finished the rollout says IDLE, and a drafter worker starts training on
a device the trainer is about to use for its old-logprob pass and update: two trainers on one device, each
slower, and on a GPU short of memory. While lent, an idle replica says LENT instead, and drafter workers, which
train only on IDLE, stay off; the backend also releases what it can (SGLang: its KV cache).

The lease lapses by itself (`on_lapse`, on the event loop) so that a trainer killed mid-update cannot keep the
devices from the drafter forever. Lives on the pool's asyncio loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class DeviceLease:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_lapse: Callable[[], None]) -> None:
        self._loop = loop
        self._on_lapse = on_lapse
        self.holder = ""
        self._deadline = 0.0  # time.monotonic() at which it lapses
        self._timer: asyncio.TimerHandle | None = None

    @property
    def lent(self) -> bool:
        return bool(self.holder)

    def expires_in(self) -> float:
        return max(0.0, self._deadline - time.monotonic()) if self.lent else 0.0

    def grant(self, holder: str, lease_s: float) -> bool:
        """Lend to `holder` for `lease_s` seconds from now, or renew. True when the devices were not lent before."""
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        fresh = not self.lent
        self.holder = holder or "trainer"
        self._deadline = time.monotonic() + lease_s
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(lease_s, self._lapse)
        return fresh

    def end(self) -> str:
        """Take the devices back; returns who had them ("" when nobody did)."""
        holder, self.holder = self.holder, ""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return holder

    def _lapse(self) -> None:  # a renewal or an end cancels the timer: when it fires, the lease is over
        self._timer = None
        if self.lent:
            self._on_lapse()
