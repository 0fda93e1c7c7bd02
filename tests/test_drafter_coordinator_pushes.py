"""The drafter coordinator's pushes to the rollout and its checkpoints, across failures and restarts: a
published version is checkpointed before the publish returns, a failed or cut push is still owed (sent again,
after a restart too), a push refused for a newer foreign drafter is renumbered, checkpoints are durable and
a failed write does not stop later ones. The real coordinator on a tiny random Qwen2 (tests/drafter_helpers.py);
the rollout's UpdateWeights is a recording or scripted function, and `mean_accept_length`'s scores are scripted
so that the candidate wins or loses by construction."""

from __future__ import annotations

import os
import time

import pytest

from drafter_helpers import gated_coordinator, model_dir, wait_for  # noqa: F401 (fixtures)
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.services.drafter.training import load_state
from tlt.services.rollout.client import WeightPushError


def test_a_published_version_is_checkpointed_before_the_publish_returns(tmp_path, model_dir, monkeypatch) -> None:
    """The rollout serves a published drafter at once; a coordinator killed (-9) right after the publish,
    before its background saver ran, must not restart with an older candidate/serving version (it would
    reuse a version number the rollout serves with other weights, and gate against a stale serving one)."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    pushes: list = []
    coord = gated_coordinator(tmp_path, model_dir, lambda t, v: pushes.append(v))  # not started: no saver
    try:
        scores = iter([(2.0, 10), (1.0, 10)])  # candidate, then serving
        monkeypatch.setattr(coordinator_mod, "mean_accept_length", lambda *a, **k: next(scores))
        with coord._lock:
            coord.candidate_version = 3  # as after three deltas
        rec = coord.evaluate_and_publish()
        assert rec is not None and rec.published and pushes == [3]
        saved = load_state(coord.ckpt)  # what a restart after kill -9 would see
        assert saved is not None and saved["serving_version"] == 3 and saved["candidate_version"] >= 3
        again = Coordinator(coord.cfg, str(model_dir), None, None)  # the restart
        try:
            assert again.serving_version == 3 and again.candidate_version >= 3 and again.acceptance[-1].published
        finally:
            again.close_sockets()
    finally:  # never started: only its socket to close
        coord.close_sockets()


def test_a_push_that_fails_leaves_the_candidate_due_for_the_next_gate(tmp_path, model_dir, monkeypatch) -> None:
    """The gate's boundary logs a failed push and retries later: the candidate must stay due (it was marked
    evaluated before the push, so a failed push waited for the next delta, which may never come)."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    pushes: list = []

    def publish(tensors, version):  # noqa: ANN001
        pushes.append(version)
        if len(pushes) == 1:
            raise ConnectionError("rollout unavailable")

    coord = gated_coordinator(tmp_path, model_dir, publish)  # not started: the gate is called by hand
    try:
        with coord._lock:
            coord.candidate_version = 3
        scores = iter([(2.0, 10), (1.0, 10), (2.0, 10), (1.0, 10)])  # candidate, serving; twice
        monkeypatch.setattr(coordinator_mod, "mean_accept_length", lambda *a, **k: next(scores))
        with pytest.raises(ConnectionError):
            coord.evaluate_and_publish()
        assert coord.candidate_version > coord._evaluated and coord.serving_version < 3  # still due, not serving
        rec = coord.evaluate_and_publish()  # the next gate, no new delta
        assert rec is not None and rec.published and pushes == [3, 3] and coord.serving_version == 3
    finally:
        coord.close_sockets()


def test_a_restarted_coordinator_pushes_its_restored_serving_drafter(tmp_path, model_dir) -> None:
    """`tlt run --resume` restarts the rollout with its initial drafter while the coordinator restores
    serving version N: without a push of N the rollout drafted with the initial drafter until a candidate
    beat N by the margin. A rollout that already serves N or a newer one (only the drafter service
    restarted) refuses it, which ends the republish too: told by the version the refusal carries
    (`WeightPushError.serving_version`), not by the words of its message. A refusal from a rollout that
    serves an older drafter (e.g. the push failed validation) is retried, whatever its message says.
    `publish` stands in for the gRPC push (tests/test_rollout_hotswap.py checks the real refusal's version)."""
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False)
    first = Coordinator(cfg, str(model_dir), None, None)
    try:
        with first._lock:
            first.serving_version = first.candidate_version = 3
        first.save_now()
    finally:
        first.close_sockets()

    for serving in (None, 3, 5):  # None: the push is taken; else the version the refusing rollout serves
        pushes: list[int] = []

        def publish(tensors, version):  # noqa: ANN001
            pushes.append(version)
            assert not any("embed" in k or "lm_head" in k for k in tensors)
            if serving is not None:
                raise WeightPushError(f"drafter v{version} refused: the replicas serve v{serving}", serving)

        coord = Coordinator(cfg, str(model_dir), None, publish).start()
        try:
            deadline = time.monotonic() + 10
            while coord._pending is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # a few more gate rounds: no second push
            assert pushes == [3] and coord._pending is None
            assert coord.candidate_version == (serving or 3)  # the next candidate numbers above what it serves
        finally:
            coord.close()

    pushes = []

    def older(tensors, version):  # noqa: ANN001
        pushes.append(version)
        raise WeightPushError(f"drafter version {version} is not newer than ... (a message that says so wrongly)", 2)

    coord = Coordinator(cfg, str(model_dir), None, older).start()
    try:
        deadline = time.monotonic() + 10
        while not pushes and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert pushes == [3] and (coord._pending is not None)  # the rollout serves v2 < 3: pushed again later
    finally:
        coord.close()


def test_a_durable_checkpoint_fsyncs_its_folder_after_the_rename(tmp_path, monkeypatch) -> None:
    """`save_atomic(fsync=True)` (coordinator.pt before and after a publish) promises a state that survives a
    power loss. The file's own fsync does not make the rename durable: until the folder's entry is on disk a
    power loss can bring back the old coordinator.pt, and with it a serving version below what the rollout
    serves. The real fsync runs; the spy only records what was fsynced, and when."""
    from tlt.services.drafter.training import save_atomic

    path = tmp_path / "ckpt" / "coordinator.pt"
    calls: list[tuple[str, int, bool]] = []  # (what, inode, was the rename done?)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.fstat(fd).st_ino, path.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", 0, False)), real_replace(a, b)))
    save_atomic(path, {"serving_version": 3}, fsync=True)
    folder = os.stat(path.parent).st_ino
    assert load_state(path) == {"serving_version": 3}
    assert ("fsync", folder, True) in calls, calls
    assert calls.index(("fsync", folder, True)) > calls.index(("replace", 0, False))
    calls.clear()
    save_atomic(path, {"serving_version": 4})  # without fsync (the frequent saves): no flush at all
    assert [c for c in calls if c[0] == "fsync"] == []


def test_a_push_that_failed_is_sent_again_even_when_no_longer_better(tmp_path, model_dir, monkeypatch) -> None:
    """A push that fails on one replica of two leaves that one on the old drafter and the other on the new
    one; the rollout keeps reporting the old version and asks for the push again (replicas.py). The gate only
    re-evaluated: once the candidate no longer won by the margin (new held-out data, noise) it was never
    pushed again, and the replicas drafted with different drafters for good. The failed push must be sent
    again as it was until it lands. `publish` stands in for the gRPC push (the refusal is the one
    ReplicaPool.update_weights gives); the gate's scores are scripted."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    pushes: list[int] = []

    def publish(tensors, version):  # noqa: ANN001
        pushes.append(version)
        if len(pushes) == 1:
            raise WeightPushError(f"update applied on replicas [0] but FAILED on: replica 1: died (replicas now "
                                  f"serve different weights; push again)", 0)

    scores = []  # the candidate wins the first evaluation, then ties with the serving drafter

    def score(*a, **k):  # noqa: ANN002, ANN003, ANN202
        scores.append(1)
        return (2.0, 10) if len(scores) == 1 else (1.0, 10)

    monkeypatch.setattr(coordinator_mod, "mean_accept_length", score)
    coord = gated_coordinator(tmp_path, model_dir, publish, eval_interval_s=0.2)
    with coord._lock:
        coord.candidate_version = 3
    coord.start()
    try:
        deadline = time.monotonic() + 15
        while (len(pushes) < 2 or coord.serving_version != 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pushes == [3, 3] and coord.serving_version == 3, (pushes, coord.serving_version, len(scores))
        time.sleep(0.6)  # landed: not sent a third time
        assert pushes == [3, 3] and load_state(coord.ckpt)["serving_version"] == 3
    finally:
        coord.close()


def test_a_save_removes_the_temporary_files_of_writers_killed_mid_save(tmp_path) -> None:
    """A kill -9 during torch.save leaves `.coordinator.pt.<pid>.tmp` behind (a whole checkpoint: ~1 GB for a
    real drafter with its optimizer state); the next save removes those of pids that no longer run."""
    import subprocess
    import sys

    from tlt.services.drafter.training import save_atomic

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ckpt = tmp_path / "coordinator.pt"
    stale = tmp_path / f".coordinator.pt.{dead.pid}.tmp"
    live = tmp_path / f".coordinator.pt.{os.getppid()}.tmp"  # a writer that still runs: never touched
    other = tmp_path / f".worker.pt.{dead.pid}.tmp"  # another checkpoint's file: not this save's business
    for f in (stale, live, other):
        f.write_bytes(b"partial")
    save_atomic(ckpt, {"x": 1})
    assert not stale.exists() and live.exists() and other.exists()
    assert load_state(ckpt) == {"x": 1}


def _a_better_candidate(coord, version: int, monkeypatch) -> None:  # noqa: ANN001
    """Make the (unstarted) coordinator's candidate differ from its serving drafter and score above it."""
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    scores = iter([(2.0, 10), (1.0, 10)])  # candidate, then serving
    monkeypatch.setattr(coordinator_mod, "mean_accept_length", lambda *a, **k: next(scores))
    with coord._lock:
        for v in coord.candidate.parameters():
            v.add_(0.01)  # the candidate differs from the initial serving drafter
        coord.candidate_version = version


def _v1_wins_and_is_refused(coord, monkeypatch) -> dict:  # noqa: ANN001
    """Candidate v1 wins the gate and the rollout (serving a newer foreign drafter) refuses its push as not newer;
    returns v1's tensors, the weights that won."""
    from tlt.services.drafter.training import own_tensors

    _a_better_candidate(coord, 1, monkeypatch)
    won = own_tensors(coord.candidate)
    with pytest.raises(WeightPushError):
        coord.evaluate_and_publish()
    return won


@pytest.mark.parametrize("landed", [True, False])
def test_a_push_cut_by_a_coordinator_kill_is_still_owed_after_the_restart(tmp_path, model_dir, monkeypatch,
                                                                          landed) -> None:
    """kill -9 while a candidate push is in flight (or while a failed one waits to be sent again): the disk holds
    the checkpoint written before the push, serving version 0. The restarted coordinator forgot the push: a push
    that landed left it gating new candidates against the drafter the rollout no longer serves, and one that
    landed on some replicas only (`landed=False`) was never sent again, the replicas drafting with different
    drafters until a candidate won by the margin. The owed push is checkpointed and sent (or, refused as already
    served, adopted as serving) by the restarted coordinator. `publish` stands in for the gRPC push; the kill is
    a copy of the checkpoint folder as the push runs (what a kill -9 at that moment leaves on disk)."""
    import shutil

    import torch

    killed = tmp_path / "at-kill"

    def publish(tensors, version):  # noqa: ANN001
        shutil.copytree(tmp_path / "ckpt", killed)
        if not landed:
            raise WeightPushError("update applied on replicas [0] but FAILED on: replica 1: died", 0)

    coord = gated_coordinator(tmp_path, model_dir, publish)  # not started: no saver, the gate is called by hand
    try:
        _a_better_candidate(coord, 3, monkeypatch)
        pushed = {k: v.clone() for k, v in coord.candidate.state_dict().items()}
        if landed:
            assert coord.evaluate_and_publish().published
        else:
            with pytest.raises(WeightPushError):
                coord.evaluate_and_publish()
    finally:
        coord.close_sockets()

    pushes: list[int] = []

    def again_publish(tensors, version):  # noqa: ANN001
        pushes.append(version)
        if landed:  # the rollout serves it already
            raise WeightPushError(f"drafter version {version} is not newer than the serving {version}", version)

    cfg = coord.cfg.model_copy(update={"checkpoint_dir": str(killed)})
    again = Coordinator(cfg, str(model_dir), None, again_publish)  # the restart
    try:
        again.push_pending()
        assert pushes == [3] and again.serving_version == 3
        assert all(torch.equal(again.serving[k], pushed[k]) for k in pushed)
        assert load_state(again.ckpt)["serving_version"] == 3
    finally:
        again.close_sockets()


def test_a_failed_checkpoint_write_does_not_stop_later_ones(tmp_path, model_dir) -> None:
    """The background saver writes coordinator.pt after every change. A write that failed (a full disk, an I/O
    error) raised out of the saver thread, which ended: nothing was checkpointed again (silently), and a later
    kill -9 lost every delta since. The saver logs the failure and writes again. The failure is real: a folder
    sits where the saver's temporary file goes."""
    from tlt.services.drafter.training import tensors_message
    from tlt.services.drafter.training import own_tensors
    from tlt.v1 import drafter_pb2

    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False, eval_interval_s=1e9)
    coord = Coordinator(cfg, str(model_dir), None, None).start()
    blocker = coord.ckpt.parent / f".{coord.ckpt.name}.{os.getpid()}.tmp"
    blocker.mkdir(parents=True)
    try:
        zero = {k: v * 0 for k, v in own_tensors(coord.candidate).items()}

        def delta(base: int) -> drafter_pb2.DeltaUpdate:
            m, p = tensors_message(zero, base)
            return drafter_pb2.DeltaUpdate(base_version=base, manifest=m, payload=p, micro_steps=1)

        assert coord.apply_delta(delta(0)) == 1
        time.sleep(2.0)  # the saver tried (and failed)
        assert load_state(coord.ckpt) is None
        blocker.rmdir()  # the disk is fine again: the write still owed is made, with no further change
        assert wait_for(lambda: (load_state(coord.ckpt) or {}).get("candidate_version") == 1, 10)
        assert coord.apply_delta(delta(1)) == 2
        deadline = time.monotonic() + 10
        while (load_state(coord.ckpt) or {}).get("candidate_version") != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (load_state(coord.ckpt) or {}).get("candidate_version") == 2
    finally:
        if blocker.exists():
            blocker.rmdir()
        coord.close()


def test_a_candidate_whose_checkpoint_write_failed_is_not_pushed(tmp_path, model_dir, monkeypatch) -> None:
    """A candidate that wins the gate is checkpointed as owed before it is pushed (a restart must never number a
    candidate at or below a version the rollout serves). When that write fails, the push is not made, now or by the
    gate's retries (`push_pending`): nothing owed that is not on disk. The failure is real: a folder sits where the
    write's temporary file goes."""
    import tlt.services.drafter.coordinator_gate as gate

    pushes: list[int] = []
    coord = gated_coordinator(tmp_path, model_dir, lambda t, v: pushes.append(v))  # not started: no saver
    blocker = coord.ckpt.parent / f".{coord.ckpt.name}.{os.getpid()}.tmp"
    blocker.mkdir(parents=True)
    try:
        scores = iter([(2.0, 10), (1.0, 10)])  # candidate, then serving
        monkeypatch.setattr(gate, "mean_accept_length", lambda *a, **k: next(scores))
        with coord._lock:
            coord.candidate_version = 3
        with pytest.raises(OSError):
            coord.evaluate_and_publish()
        coord.push_pending()  # the gate loop's next round
        assert pushes == [] and coord._pending is None and coord.serving_version == 0
    finally:
        blocker.rmdir()
        coord.close_sockets()


class _RolloutServing:
    """Stands in for the rollout's UpdateWeights: it serves drafter `version` (pushed by someone else: a coordinator
    whose checkpoint_dir was lost or moved) and refuses, as the real one does, any version not newer."""

    def __init__(self, version: int) -> None:
        self.version, self.tensors, self.pushes = version, None, []

    def __call__(self, tensors, version) -> None:  # noqa: ANN001
        self.pushes.append(version)
        if version <= self.version:
            raise WeightPushError(f"drafter version {version} is not newer than the serving {self.version}",
                                  self.version)
        self.version, self.tensors = version, tensors


@pytest.mark.parametrize("moved_on", [False, True])
def test_a_push_refused_for_a_newer_foreign_drafter_is_renumbered_and_sent(tmp_path, model_dir, monkeypatch,
                                                                          moved_on) -> None:
    """A coordinator started on a fresh checkpoint_dir while the rollout kept serving drafter v10: its candidate v1
    wins the gate and is refused as not newer. That refusal was taken as "already served": status said serving v1
    while the rollout ran v10 and never got the trained weights, and every later candidate up to v10 went the same
    way. Only a version this coordinator restored as pushed (pending or serving) may end as already served; any
    other is renumbered above the rollout's version and sent, and the next candidate numbers above that. A candidate
    that a worker's delta changed meanwhile (`moved_on`) gets a number of its own: one number, one drafter."""
    import torch

    from tlt.services.drafter.training import tensors_message
    from tlt.v1 import drafter_pb2

    def delta(base: int, by: float) -> drafter_pb2.DeltaUpdate:
        m, p = tensors_message({k: torch.full_like(v, by) for k, v in won.items()}, base)
        return drafter_pb2.DeltaUpdate(base_version=base, manifest=m, payload=p)

    rollout = _RolloutServing(10)
    coord = gated_coordinator(tmp_path, model_dir, rollout)  # not started: the gate is called by hand
    try:
        won = _v1_wins_and_is_refused(coord, monkeypatch)
        if moved_on:
            assert coord.apply_delta(delta(1, 0.001)) == 2
        coord.push_pending()  # the gate loop's next round
        assert rollout.version == 11 and rollout.pushes == [1, 1, 11], rollout.pushes
        assert all(torch.equal(rollout.tensors[k], won[k]) for k in won)  # the weights that won the gate
        assert coord._pending is None and coord.serving_version == 11
        assert coord.candidate_version == (12 if moved_on else 11)
        assert load_state(coord.ckpt)["serving_version"] == 11
        assert coord.apply_delta(delta(coord.candidate_version, 0.0)) == (13 if moved_on else 12)
    finally:
        coord.close_sockets()


def test_a_renumbered_push_is_checkpointed_under_its_new_number_before_it_is_sent(tmp_path, model_dir,
                                                                                 monkeypatch) -> None:
    """v1 is refused because the rollout serves a foreign v10, renumbered v11, and the send of v11 fails (the rollout
    went down): the checkpoint must already say v11 is owed. Saying v1 still, a restart sent v1 again, took the
    refusal as "already served" (v1 is a version it restored as pushed) and believed it served v1 while the rollout
    ran v10."""
    rollout = _RolloutServing(10)
    coord = gated_coordinator(tmp_path, model_dir, rollout)  # not started: the gate is called by hand
    try:
        _v1_wins_and_is_refused(coord, monkeypatch)

        def down(tensors, version):  # noqa: ANN001
            rollout.pushes.append(version)
            if version <= rollout.version:
                raise WeightPushError(f"drafter version {version} is not newer", rollout.version)
            raise ConnectionError("rollout unavailable")

        coord.publish_fn = down
        with pytest.raises(ConnectionError):
            coord.push_pending()  # the gate loop's next round
        assert rollout.pushes == [1, 1, 11], rollout.pushes
        saved = load_state(coord.ckpt)
        assert saved["pending"]["version"] == 11 and saved["candidate_version"] == 11 and saved["serving_version"] == 0
    finally:
        coord.close_sockets()


def test_a_checkpoint_of_another_model_is_named_in_the_error(tmp_path, model_dir) -> None:
    """`tlt drafter serve --model B` on a checkpoint_dir holding model A's coordinator.pt (the default folder is the
    same for every model) failed with "drafter tensor fc.weight: shape (64, 128), expected ...", naming neither the
    file nor what to do. The error (a DrafterError: one line and exit 2 from the CLI) names the checkpoint and says
    to give [drafter] checkpoint_dir another folder. Real checkpoints of two models of different sizes."""
    from tlt.model.drafter import DrafterError
    from tlt.model.testing import random_checkpoint

    other = random_checkpoint(tmp_path / "other", hidden_size=32, intermediate_size=64)
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               gate_when_idle=False)
    first = Coordinator(cfg, str(model_dir), None, None)  # model A's service ran here
    first.save_now()
    first.close_sockets()
    with pytest.raises(DrafterError) as err:
        Coordinator(cfg, str(other), None, None)
    msg = str(err.value)
    assert str(tmp_path / "ckpt" / "coordinator.pt") in msg and "checkpoint_dir" in msg and "\n" not in msg, msg


def test_a_push_renumbered_past_a_candidate_that_moved_beyond_the_rollout_takes_a_number_of_its_own(
        tmp_path, model_dir, monkeypatch) -> None:
    """The rollout serves a foreign drafter v3; this coordinator's v1 wins the gate and is refused as not newer, and
    workers' deltas then move the candidate to v5, past the rollout. The owed push (v1's weights) is renumbered above
    both, v6, and the candidate takes v7: numbering it above the rollout only (v4) gave the push a number the
    candidate had carried (other weights) and the candidate v5 again; one number, one drafter."""
    import torch

    from tlt.services.drafter.training import tensors_message
    from tlt.v1 import drafter_pb2

    rollout = _RolloutServing(3)
    coord = gated_coordinator(tmp_path, model_dir, rollout)  # not started: the gate is called by hand
    try:
        won = _v1_wins_and_is_refused(coord, monkeypatch)
        for base in (1, 2, 3, 4):
            m, p = tensors_message({k: torch.full_like(v, 0.001) for k, v in won.items()}, base)
            assert coord.apply_delta(drafter_pb2.DeltaUpdate(base_version=base, manifest=m, payload=p)) == base + 1
        coord.push_pending()
        assert rollout.pushes == [1, 1, 6] and rollout.version == 6, rollout.pushes
        assert all(torch.equal(rollout.tensors[k], won[k]) for k in won)  # v1's weights, under v6
        assert coord.serving_version == 6 and coord.candidate_version == 7
        assert load_state(coord.ckpt)["serving_version"] == 6
    finally:
        coord.close_sockets()
