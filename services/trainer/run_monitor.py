"""What `tlt run` watches while the trainer works: the rollout's running batch and the drafter's windows.

    RolloutSampler  thread: GetStatus every poll_interval_s -> timeline.jsonl (TimelineSample per line)
                    + rollout_status.json (the last status, written at the end: each replica's speculation,
                    the bandit's view per bucket and the steps per arm, for reading a run afterwards; protobuf's
                    JSON mapping: int64 fields are strings)
    DrafterSampler  thread: Drafter/GetStatus every second -> drafter.jsonl (each new training window once)
                    + drafter_status.json (the latest status, for the report)

Both are observers at a deliberate boundary: a status call that fails (a
service restarting or gone) is skipped and the next one tried; the launcher
itself notices services that die.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import grpc

from tlt.services.common.logging import get_logger
from tlt.services.trainer.run_stats import IdleWindow, TimelineSample, open_append

log = get_logger("run.monitor")


class _Poller(threading.Thread):
    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self._halt = threading.Event()
        self.failures = 0
        self._said_at = -math.inf

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll()
            except grpc.RpcError:  # the service is (re)starting or gone: keep sampling
                self.failures += 1
            except OSError as e:  # the run folder's disk is full (or gone): said once a minute, sampling goes on
                self.failures += 1
                if time.monotonic() - self._said_at > 60:
                    self._said_at = time.monotonic()
                    log.warning("sample_not_written", sampler=type(self).__name__, error=str(e)[:200])
            self._halt.wait(self.interval_s)

    def poll(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class RolloutSampler(_Poller):
    def __init__(self, address: str, path: Path, interval_s: float, since_step: int = 0) -> None:
        """since_step: the steps done when this launch started (a resume): its rollout server counts from there."""
        from tlt.services.rollout.client import RolloutClient

        super().__init__(interval_s)
        self.since_step = since_step
        self.client = RolloutClient(address, timeout_s=5.0)
        self.out = open_append(path)
        self.status_path = path.parent / "rollout_status.json"
        self.last = None  # the latest RolloutStatus (written once, at close: a poll only keeps the message)
        self.samples = 0

    def poll(self) -> None:
        import time

        st = self.client.status()
        t = time.time()
        self.last = st
        reps = list(st.replicas)
        s = TimelineSample(t, tuple(r.running for r in reps), tuple(r.queued for r in reps),
                           tuple(bool(r.spec.active) for r in reps), int(st.versions.policy), int(st.versions.drafter))
        self.out.write(s.to_json() + "\n")
        self.out.flush()
        self.samples += 1

    def close(self) -> None:
        super().close()
        self.client.close()
        try:
            self.out.close()
        except OSError as e:  # its last lines could not be written (a full disk): the rest of the run's stop goes on
            log.warning("timeline_not_written", error=str(e)[:200])
        if self.last is not None:  # a report's extra: failing to write it must not keep the launcher from
            from google.protobuf.json_format import MessageToDict  # stopping the services

            try:
                tmp = self.status_path.with_suffix(".tmp")
                status = MessageToDict(self.last, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)
                tmp.write_text(json.dumps({"since_step": self.since_step, **status}, indent=1))
                tmp.replace(self.status_path)
            except (OSError, ValueError) as e:
                log.warning("rollout_status_not_written", path=str(self.status_path), error=str(e))


class DrafterSampler(_Poller):
    def __init__(self, address: str, run_dir: Path, interval_s: float = 1.0) -> None:
        from tlt.v1 import drafter_pb2_grpc

        super().__init__(interval_s)
        self.channel = grpc.insecure_channel(address)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.windows_path = run_dir / "drafter.jsonl"
        self.status_path = run_dir / "drafter_status.json"
        self.seen = {(w.worker_id, round(w.start, 6)) for w in _read_windows(self.windows_path)}
        self.serving_version = -1
        # Start of the last poll that saw no worker training: every window open before then has ended
        # and is in drafter.jsonl (the live table waits for it; run_stats.settled). 0: not seen yet.
        self.quiet_since = 0.0

    def poll(self) -> None:
        import time

        from google.protobuf.json_format import MessageToDict

        from tlt.v1 import drafter_pb2

        t = time.time()  # before the call: the status it answers is at least this recent
        st = self.stub.GetStatus(drafter_pb2.DrafterStatusRequest(), timeout=5.0)
        self.serving_version = int(st.serving_version)
        new = []
        for w in st.windows:
            key = (w.worker_id, round(w.start, 6))
            if w.end > 0 and key not in self.seen:
                self.seen.add(key)
                new.append(IdleWindow(w.worker_id, w.replica_id, w.start, w.end, int(w.micro_steps), bool(w.preempted)))
        if new:
            with open_append(self.windows_path) as f:
                for w in new:
                    f.write(json.dumps(w.__dict__) + "\n")
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(MessageToDict(st, preserving_proto_field_name=True)))
        tmp.replace(self.status_path)
        if not any(w.training for w in st.workers):  # after the windows are on file
            self.quiet_since = t

    def close(self) -> None:
        super().close()
        self.channel.close()


def _read_windows(path: Path) -> list[IdleWindow]:
    from tlt.services.trainer.run_stats import read_windows

    return read_windows(path)
