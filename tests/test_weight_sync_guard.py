"""The trainer side of a weight push, pinned where the suite let a changed rule through.

Units, with stand-in rollout servers: VersionGuard's choice of servers to push again (`_behind`), the push report's
apply time, the start-up dtype check, and which tensors the push casts. A stand-in server answers `status()` and
`update_weights()` with the real protos (RolloutStatus, UpdateWeightsResponse) a rollout server sends; the pushes go
through a real WeightPublisher and the rollouts are real collect.RolloutResult / ScoredCompletion objects. A real
server adds nothing to these rules: each case needs servers in states (several versions at once, one on a newer
version, an older server naming no dtype, a given apply time) that real ones reach only through restarts or a
second trainer; the push to, and the version check against, a real server are in tests/test_trainer_weight_sync.py
and tests/test_trainer_stale_rollout.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tlt.services.trainer.collect import RolloutResult
from tlt.services.trainer.types import ScoredCompletion
from tlt.services.trainer.weight_sync import (
    PushDtypeError,
    StaleWeightsError,
    VersionGuard,
    WeightPublisher,
    check_push_dtype,
    policy_tensors,
)
from tlt.v1 import common_pb2, rollout_pb2


class FakeServer:
    """A rollout server's status and push answers: the policy version it serves, its dtype, its apply time."""

    def __init__(self, address: str, policy: int = 0, dtype: str = "float32", apply_seconds: float = 0.0) -> None:
        self.address, self.policy, self.dtype, self.apply_seconds = address, policy, dtype, apply_seconds
        self.pushes: list[int] = []

    def status(self) -> rollout_pb2.RolloutStatus:
        return rollout_pb2.RolloutStatus(model="tiny", backend="native", dtype=self.dtype,
                                         versions=common_pb2.WeightVersions(policy=self.policy))

    def update_weights(self, tensors, kind: str, version: int, shm: bool = False) -> rollout_pb2.UpdateWeightsResponse:
        self.pushes.append(version)
        self.policy = version
        return rollout_pb2.UpdateWeightsResponse(ok=True, kind=common_pb2.WEIGHT_KIND_POLICY, version=version,
                                                 apply_seconds=self.apply_seconds, replicas=[len(self.pushes) - 1])


def rollout(version: int, n: int = 2) -> RolloutResult:
    return RolloutResult(samples=[ScoredCompletion(prompt_index=0, sample_index=i, prompt_ids=(1, 2), response_ids=(3,),
                                                   reward=0.0, policy_version=version) for i in range(n)])


def guard_with(servers: list[FakeServer], versions: list[int]):
    """A VersionGuard over `servers` whose repush is a real WeightPublisher's push to the servers it names, and a
    roll_out whose k-th rollout's completions carry versions[k]. Returns (guard, roll_out, pushed, rollouts)."""
    publisher = WeightPublisher(servers)
    pushed: list[str] = []
    rollouts: list[int] = []

    def repush(behind, version):
        pushed.extend(c.address for c in behind)
        publisher.push({"w": torch.zeros(2)}, version, clients=behind)

    def roll_out() -> RolloutResult:
        rollouts.append(1)
        return rollout(versions[len(rollouts) - 1])

    return VersionGuard(servers, repush), roll_out, pushed, rollouts


def test_a_restart_pushes_again_to_the_restarted_server_alone() -> None:
    """Two servers: one serves v3 (the push reached it), one restarted and serves its start checkpoint (v0). Only
    the restarted one gets the weights again; the one already on v3 is not pushed a second time."""
    up, restarted = FakeServer("up-to-date", policy=3), FakeServer("restarted", policy=0)
    guard, roll_out, pushed, rollouts = guard_with([up, restarted], versions=[0, 3])
    result = guard.collect(roll_out, 3)
    assert pushed == ["restarted"] and guard.repushes == 1
    assert up.pushes == [] and restarted.pushes == [3]
    assert len(rollouts) == 2 and result.retries == 1 and {s.policy_version for s in result.samples} == {3}


def test_a_server_on_a_newer_version_stops_the_run_at_once() -> None:
    """One server serves v9 (another trainer pushes to it), one restarted (v0); this trainer pushed v3. A second
    push of ours would not fix the v9 one: the stale rollout fails as it is, nothing is pushed, nothing rolled out
    again."""
    newer, restarted = FakeServer("newer", policy=9), FakeServer("restarted", policy=0)
    guard, roll_out, pushed, rollouts = guard_with([newer, restarted], versions=[9, 9])
    with pytest.raises(StaleWeightsError, match=r"version\(s\) \[9\]"):
        guard.collect(roll_out, 3)
    assert pushed == [] and guard.repushes == 0 and restarted.pushes == [] and newer.pushes == []
    assert len(rollouts) == 1


def test_push_report_apply_time_is_the_slowest_servers() -> None:
    """Servers answer one after another; the report's apply time is the slowest one's (2.0 s), not the last's."""
    slow, fast = FakeServer("slow", apply_seconds=2.0), FakeServer("fast", apply_seconds=0.1)
    report = WeightPublisher([slow, fast]).push({"w": torch.zeros(2)}, 1)
    assert report.apply_seconds == 2.0
    assert report.version == 1 and report.bytes == 8 and report.replicas == (0, 0)
    assert WeightPublisher([fast, slow]).push({"w": torch.zeros(2)}, 2).apply_seconds == 2.0


def test_a_server_naming_no_dtype_is_not_checked() -> None:
    """An older rollout server's status has no dtype field (read as ""); so does one whose tensors differ in dtype.
    The start-up check cannot compare and lets the run start, as check_push_dtype's docstring says; a server naming
    another dtype is refused."""
    cfg = SimpleNamespace(push_dtype="auto", bf16=None)
    older = FakeServer("127.0.0.1:46101", dtype="")
    assert older.status().dtype == ""
    check_push_dtype(cfg, False, [older])  # pushes float32
    check_push_dtype(cfg, True, [older])  # pushes bfloat16
    check_push_dtype(SimpleNamespace(push_dtype="float16", bf16=None), False, [older])
    with pytest.raises(PushDtypeError, match="127.0.0.1:46102 serves bfloat16"):
        check_push_dtype(cfg, False, [older, FakeServer("127.0.0.1:46102", dtype="bfloat16")])


def test_a_bf16_push_casts_floating_tensors_only() -> None:
    """policy_tensors in bf16: weights become bf16, an int64 buffer (a step counter) and a bool mask keep their
    dtype and values; a float cast would turn 2**40 + 1 into another number and the receiver's int64 check would
    refuse the push."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("step", torch.tensor([2**40 + 1], dtype=torch.int64))
            self.register_buffer("mask", torch.tensor([True, False]))

    out = policy_tensors(Model(), torch.bfloat16)
    assert {k: v.dtype for k, v in out.items()} == {"lin.weight": torch.bfloat16, "lin.bias": torch.bfloat16,
                                                    "step": torch.int64, "mask": torch.bool}
    assert out["step"].tolist() == [2**40 + 1] and out["mask"].tolist() == [True, False]


def test_a_push_answered_with_another_version_than_pushed_stops_the_run() -> None:
    """A server that answers a push with a version of its own (older: it kept what it served; newer: another trainer
    pushed past ours between the two) does not serve the weights just pushed: the push fails, either way."""

    class Answering(FakeServer):
        def __init__(self, address: str, answer: int) -> None:
            super().__init__(address)
            self.answer = answer

        def update_weights(self, tensors, kind: str, version: int, shm: bool = False):
            return rollout_pb2.UpdateWeightsResponse(ok=True, kind=common_pb2.WEIGHT_KIND_POLICY, version=self.answer)

    for answer in (2, 4):
        with pytest.raises(StaleWeightsError, match=f"answered version {answer}, pushed 3"):
            WeightPublisher([FakeServer("fine"), Answering("odd", answer)]).push({"w": torch.zeros(2)}, 3)


def test_repushes_counts_every_server_given_the_weights_again() -> None:
    """Two of three servers restarted (v0) after the push of v3: both get the weights again, and `repushes` counts
    the servers (2), not the rollouts redone (1)."""
    a, b, up = FakeServer("a", policy=0), FakeServer("b", policy=0), FakeServer("up", policy=3)
    guard, roll_out, pushed, rollouts = guard_with([a, up, b], versions=[0, 3])
    guard.collect(roll_out, 3)
    assert pushed == ["a", "b"] and guard.repushes == 2 and len(rollouts) == 2


def test_a_server_one_version_ahead_is_newer_too() -> None:
    """The pushed v3 and a server on v4, the very next version (another trainer's first push after ours): newer, so
    nothing is pushed again and the stale rollout fails as it is, as for any newer version."""
    newer, restarted = FakeServer("newer", policy=4), FakeServer("restarted", policy=0)
    guard, roll_out, pushed, rollouts = guard_with([newer, restarted], versions=[4, 4])
    with pytest.raises(StaleWeightsError, match=r"version\(s\) \[4\]"):
        guard.collect(roll_out, 3)
    assert pushed == [] and guard.repushes == 0 and len(rollouts) == 1
