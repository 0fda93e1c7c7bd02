"""What `tlt run` samples from the drafter service (services/trainer/run_monitor.py DrafterSampler): each training
window once it has ended, in drafter.jsonl, and the time from which every window is on file (`quiet_since`), over a
real `tlt.v1.Drafter/GetStatus` gRPC server on 127.0.0.1 (the service's own, drafter/serve.py) answering statuses
set by the test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tlt.services.drafter.serve import start_status_server
from tlt.services.trainer.run_monitor import DrafterSampler
from tlt.v1 import drafter_pb2


class _Statuses:
    """A coordinator whose status() is whatever the test set last; `fail` calls raise first (the service answers
    them with an error, as one restarting does); `asked` the time of each call."""

    def __init__(self) -> None:
        self.now = drafter_pb2.DrafterStatus()
        self.fail = 0
        self.asked: list[float] = []

    def status(self) -> drafter_pb2.DrafterStatus:
        self.asked.append(time.time())
        if self.fail:
            self.fail -= 1
            raise RuntimeError("restarting")
        return self.now


def _status(windows: list[tuple[int, float, float]], training: bool | tuple[bool, ...]) -> drafter_pb2.DrafterStatus:
    """training: one worker's, or each worker's."""
    flags = training if isinstance(training, tuple) else (training,)
    return drafter_pb2.DrafterStatus(
        serving_version=2, workers=[drafter_pb2.WorkerStatus(worker_id=i, alive=True, training=t)
                                    for i, t in enumerate(flags)],
        windows=[drafter_pb2.TrainingWindow(worker_id=w, start=s, end=e, micro_steps=3) for w, s, e in windows])


@contextmanager
def _sampler(tmp_path: Path, statuses: _Statuses, interval_s: float = 1.0) -> Iterator[DrafterSampler]:
    server, port = start_status_server(statuses, "127.0.0.1", 0)
    sampler = DrafterSampler(f"127.0.0.1:{port}", tmp_path, interval_s)
    try:
        yield sampler
    finally:
        sampler.channel.close()
        server.stop(grace=0).wait()  # type: ignore[attr-defined]


def _on_file(tmp_path: Path) -> list[tuple[int, float]]:
    return [(w["worker_id"], w["end"]) for w in map(json.loads, (tmp_path / "drafter.jsonl").read_text().splitlines())]


def test_a_window_is_on_file_once_it_has_ended_and_quiet_since_waits_for_the_training_to_stop(tmp_path: Path) -> None:
    """A window still open (end 0) is not written: written then, it stayed in drafter.jsonl with no end (its end
    never written: each window is written once), and the step's idle time counted nothing of it."""
    statuses = _Statuses()
    with _sampler(tmp_path, statuses) as sampler:
        statuses.now = _status([(0, 100.0, 101.0), (1, 102.0, 0.0)], training=True)
        sampler.poll()
        assert _on_file(tmp_path) == [(0, 101.0)]
        assert sampler.quiet_since == 0.0 and sampler.serving_version == 2  # a worker trains: windows may come
        statuses.now = _status([(0, 100.0, 101.0), (1, 102.0, 104.0)], training=False)
        before = time.time()
        sampler.poll()
        sampler.poll()  # a status seen again adds nothing
        assert _on_file(tmp_path) == [(0, 101.0), (1, 104.0)]
        assert sampler.quiet_since >= before
        assert json.loads((tmp_path / "drafter_status.json").read_text())["serving_version"] == "2"


def test_quiet_since_waits_for_every_worker_and_is_the_time_before_the_status_was_asked(tmp_path: Path) -> None:
    """With two drafter workers, one still training keeps windows coming: quiet_since moved on while any worker was
    idle let the live table settle a step before the other worker's window was on file. And it is the poll's start,
    not its end: a window that ended while the status was being answered is not in that status, and a later
    quiet_since declared it on file."""
    statuses = _Statuses()
    with _sampler(tmp_path, statuses) as sampler:
        statuses.now = _status([], training=(True, False))
        sampler.poll()
        assert sampler.quiet_since == 0.0
        statuses.now = _status([], training=(False, False))
        sampler.poll()
        assert 0.0 < sampler.quiet_since <= statuses.asked[-1]


def test_a_relaunch_does_not_write_again_the_windows_on_file(tmp_path: Path) -> None:
    """A resumed `tlt run` reads drafter.jsonl back: the windows it holds are not written a second time when the
    drafter service (restarted with the run) still reports them, though their start times carry microseconds (the
    keys must be rounded as the poll rounds them: each window counted twice doubled the step's idle time)."""
    statuses = _Statuses()
    statuses.now = _status([(0, 1700000000.123456, 1700000001.5)], training=False)
    with _sampler(tmp_path, statuses) as sampler:
        sampler.poll()
    with _sampler(tmp_path, statuses) as sampler:
        sampler.poll()
    assert _on_file(tmp_path) == [(0, 1700000001.5)]


def test_a_failed_status_call_does_not_stop_the_sampling(tmp_path: Path) -> None:
    """The drafter service restarting answers a status call with an error: the sampler thread counts it and goes on
    (a thread that died there left drafter.jsonl without every later window: the report's idle time read 0)."""
    statuses = _Statuses()
    statuses.fail = 2
    statuses.now = _status([(0, 100.0, 101.0)], training=False)
    with _sampler(tmp_path, statuses, interval_s=0.05) as sampler:
        sampler.start()
        deadline = time.monotonic() + 20
        while not (tmp_path / "drafter.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sampler.close()
        assert sampler.failures == 2 and _on_file(tmp_path) == [(0, 101.0)]


def test_the_rollout_sampler_writes_the_timeline_and_the_last_status_with_the_step_it_counts_from(tmp_path: Path) -> None:
    """timeline.jsonl gets one sample per poll (each replica's running batch), and rollout_status.json, at close,
    the last status with `since_step`: a resumed launch's rollout server counts its speculation from there, which
    report.html says (without it, a resumed run's counts read as the whole run's). A real Rollout/GetStatus server."""
    from concurrent import futures

    import grpc

    from tlt.services.trainer.run_monitor import RolloutSampler
    from tlt.services.trainer.run_stats import read_timeline
    from tlt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    class Status(rollout_pb2_grpc.RolloutServicer):
        def GetStatus(self, request, context):  # noqa: ANN001, ANN201, N802
            return rollout_pb2.RolloutStatus(model="m", replicas=[rollout_pb2.ReplicaStatus(replica_id=0, running=5)],
                                             versions=common_pb2.WeightVersions(policy=3, drafter=1))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServicer_to_server(Status(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        sampler = RolloutSampler(f"127.0.0.1:{port}", tmp_path / "timeline.jsonl", 0.05, since_step=4)
        sampler.start()
        deadline = time.monotonic() + 20
        while sampler.samples < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        sampler.close()
        samples = read_timeline(tmp_path / "timeline.jsonl")
        assert len(samples) >= 2 and {(s.running, s.policy, s.drafter) for s in samples} == {((5,), 3, 1)}
        status = json.loads((tmp_path / "rollout_status.json").read_text())
        assert status["since_step"] == 4 and status["model"] == "m"
    finally:
        server.stop(grace=0).wait()
