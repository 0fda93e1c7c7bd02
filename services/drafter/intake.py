"""The coordinator's feature intake: FeatureBatches from the rollout (or the trainer) into its buffer.

    features socket --recv--> ingest (the coordinator's: the source filter, the buffer, the latest policy)
    held (train_when = rollout_idle) while a replica decodes: each frame is taken off the socket at once (its
        queue is short: the senders drop when it is full) and kept unparsed; all are parsed, in the order they
        came, once the rollout is idle (here, or by the gate before an evaluation: `parse_held`), or once
        HELD_FEATURE_BYTES of them wait

Under rollout_idle no worker trains while a replica decodes, so parsing the features that arrive then (protobuf,
then the buffer's windows) only took a decoding replica's CPU for data no worker could use before the rollout ended
(`tlt bench drafter-drift --overhead`, BENCHMARKS.md "Session 27"). Under replica_idle a worker may train on an idle
replica while another decodes, on the freshest features: they go in at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tlt.services.common.events import FeatureSource
from tlt.services.drafter.rollout_idle import RolloutIdle
from tlt.v1 import events_pb2

HELD_FEATURE_BYTES = 64 << 20  # held frames are parsed once this many bytes of them wait, busy or not


class FeatureIntake:
    def __init__(self, source: FeatureSource, ingest: Callable[[events_pb2.FeatureBatch], None],
                 hold_while_busy: RolloutIdle | None) -> None:
        """`hold_while_busy`: the rollout whose busy time frames are held through; None: ingest at once."""
        self.source, self.ingest, self.rollout = source, ingest, hold_while_busy
        self._held: list[list[bytes]] = []
        self._held_bytes = 0
        self._lock = threading.Lock()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if self.rollout is None:
                batch = self.source.recv(0.2)
                if batch is not None:
                    self.ingest(batch)
                continue
            frames = self.source.recv_frame(0.2)
            if (frames is not None and self._hold(frames)) or not self.rollout.busy():
                self.parse_held()

    def _hold(self, frames: list[bytes]) -> bool:
        """Keep `frames` unparsed; True when HELD_FEATURE_BYTES of them wait."""
        with self._lock:
            self._held.append(frames)
            self._held_bytes += sum(len(f) for f in frames)
            return self._held_bytes >= HELD_FEATURE_BYTES

    def parse_held(self) -> None:
        """Parse the held frames into the buffer, in the order they came."""
        with self._lock:  # held throughout: a concurrent caller must not ingest later frames first
            held, self._held, self._held_bytes = self._held, [], 0
            for frames in held:
                batch = self.source.parse(frames)
                if batch is not None:
                    self.ingest(batch)
