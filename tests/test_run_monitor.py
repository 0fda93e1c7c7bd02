"""What `tlt run` samples from the drafter service (services/trainer/run_monitor.py DrafterSampler): each training
window once it has ended, in drafter.jsonl, and the time from which every window is on file (`quiet_since`), over a
real `tlt.v1.Drafter/GetStatus` gRPC server on 127.0.0.1 (the service's own, drafter/serve.py) answering statuses
set by the test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tlt.services.drafter.serve import start_status_server
from tlt.services.trainer.run_monitor import DrafterSampler
from tlt.v1 import drafter_pb2


class _Statuses:
    """A coordinator whose status() is whatever the test set last."""

    def __init__(self) -> None:
        self.now = drafter_pb2.DrafterStatus()

    def status(self) -> drafter_pb2.DrafterStatus:
        return self.now


def _status(windows: list[tuple[int, float, float]], training: bool) -> drafter_pb2.DrafterStatus:
    return drafter_pb2.DrafterStatus(
        serving_version=2, workers=[drafter_pb2.WorkerStatus(worker_id=0, alive=True, training=training)],
        windows=[drafter_pb2.TrainingWindow(worker_id=w, start=s, end=e, micro_steps=3) for w, s, e in windows])


def test_a_window_is_on_file_once_it_has_ended_and_quiet_since_waits_for_the_training_to_stop(tmp_path: Path) -> None:
    """A window still open (end 0) is not written: written then, it stayed in drafter.jsonl with no end (its end
    never written: each window is written once), and the step's idle time counted nothing of it."""
    statuses = _Statuses()
    server, port = start_status_server(statuses, "127.0.0.1", 0)
    sampler = DrafterSampler(f"127.0.0.1:{port}", tmp_path)
    try:
        statuses.now = _status([(0, 100.0, 101.0), (1, 102.0, 0.0)], training=True)
        sampler.poll()
        lines = [json.loads(x) for x in (tmp_path / "drafter.jsonl").read_text().splitlines()]
        assert [(w["worker_id"], w["end"]) for w in lines] == [(0, 101.0)]
        assert sampler.quiet_since == 0.0 and sampler.serving_version == 2  # a worker trains: windows may come
        statuses.now = _status([(0, 100.0, 101.0), (1, 102.0, 104.0)], training=False)
        before = time.time()
        sampler.poll()
        sampler.poll()  # a status seen again adds nothing
        lines = [json.loads(x) for x in (tmp_path / "drafter.jsonl").read_text().splitlines()]
        assert [(w["worker_id"], w["end"]) for w in lines] == [(0, 101.0), (1, 104.0)]
        assert sampler.quiet_since >= before
        assert json.loads((tmp_path / "drafter_status.json").read_text())["serving_version"] == "2"
    finally:
        sampler.channel.close()
        server.stop(grace=0).wait()  # type: ignore[attr-defined]


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
