"""The trainer's side of the colocated placement: borrow the rollout's devices for its own compute.

    rollout done -> borrow()   every rollout server: LendDevices(lend, lease_s)   replicas LENT, KV released
                    (a thread renews the lease every lease_s / 3 while the trainer computes)
    old logprobs, update
    give_back()  -> every rollout server: LendDevices(false)                       replicas resume, IDLE
    -> weight push -> next rollout

Without it, a replica that finished its rollout says IDLE and the drafter's spot trainer starts on the device
that the policy trainer is about to use: on one GPU both then compete for its memory and compute, and on the
CPU's shared cores the drafter's training took ~20% from the policy update (BENCHMARKS.md, "Session 7").
The lease lapses on the rollout side if this process dies, so a crash never keeps the drafter off for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from tlt.services.common.logging import get_logger

log = get_logger("trainer.colocate")


class LendError(RuntimeError):
    """A rollout server would not lend its devices (or give them back)."""


class DeviceLoan:
    def __init__(self, clients: Sequence[Any], lease_s: float, holder: str = "trainer") -> None:
        """`clients`: RolloutClients of every rollout server whose devices this trainer shares."""
        self.clients, self.lease_s, self.holder = list(clients), lease_s, holder
        self._stop: threading.Event | None = None
        self._renewer: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._stop is not None

    def borrow(self) -> float:
        """Lend every server's devices to this trainer; returns the seconds it took (the replicas' releases)."""
        import grpc

        if self.held:  # already borrowed (and renewed by its thread): nothing to start twice
            return 0.0
        t0 = time.perf_counter()
        for c in self.clients:
            try:
                self._lend(c)
            except (grpc.RpcError, LendError) as e:
                try:
                    self.give_back()  # the ones already lent
                except LendError as back:
                    log.warning("device_give_back_failed", error=str(back)[:300])
                if isinstance(e, LendError):
                    raise
                hint = " (a rollout server without LendDevices: set [trainer] lend_rollout_devices = false)" \
                    if e.code() == grpc.StatusCode.UNIMPLEMENTED else ""
                raise LendError(f"rollout server {c.address} did not lend its devices: {e.code().name} "
                                f"{e.details()}{hint}") from None
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, args=(self._stop,), name="device-lease", daemon=True)
        self._renewer.start()
        return time.perf_counter() - t0

    def _lend(self, client: Any) -> None:
        """Lend `client`'s devices. The rollout answers lent=False when new work (or a policy push) took them back
        before the replicas had released: its replicas resumed and say IDLE, and drafter workers start on them. Lent
        once more then (a stray request); taken back again, some other client is using the rollout: LendError."""
        for attempt in (1, 2):
            if client.lend_devices(True, self.lease_s, self.holder).lent:
                return
            log.warning("device_lend_taken_back", address=client.address, attempt=attempt)
        raise LendError(f"rollout server {client.address} took the devices back before it lent them, twice: other "
                        "work reached it during the lend; with [trainer] lend_rollout_devices only this trainer may "
                        "use that rollout, or set lend_rollout_devices = false")

    def _renew(self, stop: threading.Event) -> None:
        import grpc

        while not stop.wait(self.lease_s / 3):
            for c in self.clients:
                try:
                    c.lend_devices(True, self.lease_s, self.holder)
                except grpc.RpcError as e:  # the next renewal tries again; the lease has two more thirds
                    log.warning("device_lease_not_renewed", address=c.address, code=e.code().name,
                                detail=str(e.details())[:200])

    def give_back(self) -> float:
        """Take every server's devices back (idempotent); returns the seconds it took (the replicas' resumes)."""
        import grpc

        if self._stop is not None:
            self._stop.set()
            if self._renewer is not None:
                self._renewer.join()
            self._stop = self._renewer = None
        t0 = time.perf_counter()
        failed = []
        for c in self.clients:
            try:
                c.lend_devices(False)
            except grpc.RpcError as e:
                failed.append(f"{c.address}: {e.code().name} {e.details()}")
        if failed:
            raise LendError("rollout servers did not take their devices back: " + "; ".join(failed))
        return time.perf_counter() - t0
