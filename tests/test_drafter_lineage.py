"""What the drafter coordinator pushes to the rollout after a restart of either side.

- The rollout restarted (serving its start drafter, version 0) while the coordinator ran on, serving version N:
  the coordinator went on reporting N and never pushed it again, and the rollout drafted with its start drafter
  until some later candidate beat N's stale score, and nothing said so. The capacity events carry the rollout's
  drafter version: one older than N is now reported once (`drafter_rollout_behind`), not pushed (a version does not
  say which drafter: a rollout restarted on a drafter its operator chose looks the same); a restarted coordinator
  pushes its serving drafter as owed.
- The events also say which drafter the rollout started with (`start_drafter`, the identity a coordinator's lineage
  uses): a rollout restarted on the drafter the coordinator grew from (`tlt run`'s case: the rollout's `--drafter`
  is the coordinator's `init_drafter`) gets the serving drafter again, pushed; one started on another is reported.
- DEPLOY.md's switch to a learned drafter restarts the coordinator with `init_drafter` set, on the checkpoint_dir
  of a coordinator that started from a random drafter under an n-gram rollout (its refused pushes kept as owed):
  it restored that checkpoint and pushed the owed drafter over the one the user chose, never scored against it.
  A checkpoint records the init drafter it grew from; one of another init is moved aside (nothing lost, named
  in one warning) and the coordinator starts from the configured init, with nothing owed.
- That re-push is sent once: refused as already served, it ends (no renumbered copy), and events that still show
  the old drafter after it landed do not make it owed again; a candidate push owed when the rollout restarts stays
  the push owed (the gate's rounds called by hand, on a coordinator not started).

Real coordinator on a tiny random Qwen2 (tests/drafter_helpers.py) and a real CapacityPublisher over ZeroMQ on
127.0.0.1 playing the rollout's replicas; the rollout's UpdateWeights is a recording function."""

from __future__ import annotations

import time

import pytest
import torch

from drafter_helpers import IDLE, gated_coordinator, model_dir, wait_for  # noqa: F401 (fixture)
from tlt.services.common.events import CapacityPublisher
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.coordinator import Coordinator
from tlt.services.drafter.training import load_state, new_drafter, own_tensors
from tlt.v1 import common_pb2, events_pb2


def _idle(pub: CapacityPublisher, drafter_version: int, start_drafter: str = "") -> None:
    for r in (0, 1):
        pub.publish(events_pb2.CapacityEvent(replica_id=r, state=IDLE, device="cpu", start_drafter=start_drafter,
                                             versions=common_pb2.WeightVersions(policy=0, drafter=drafter_version)))


def _unstarted(coord: Coordinator) -> None:
    coord.close_sockets()


def test_a_restarted_rollout_is_reported_and_a_restarted_coordinator_pushes_it_again(tmp_path, model_dir,
                                                                                    monkeypatch, capfd) -> None:
    import tlt.services.drafter.coordinator_gate as coordinator_mod

    monkeypatch.setattr(coordinator_mod, "REPUSH_S", 0.5)
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
                               eval_interval_s=1e9)
    first = Coordinator(cfg, str(model_dir), None, None)
    with first._lock:
        first.serving_version = first.candidate_version = 9
    first.save_now()
    _unstarted(first)
    pushes: list[int] = []
    coord = Coordinator(cfg, str(model_dir), None, lambda t, v: pushes.append(v)).start()
    try:
        _idle(pub, 0)  # the rollout serves its start drafter: the restored serving one is owed, pushed once
        assert wait_for(lambda: pushes == [9], 10)
        _idle(pub, 9)  # it took it
        time.sleep(1.5)  # several re-push periods: nothing more
        assert pushes == [9]
        _idle(pub, 0)  # the rollout restarted, with its start drafter: said once, not pushed
        assert wait_for(lambda: coord.rollout.drafter_behind(9) == 0, 10), coord.rollout.drafter_behind(9)
        assert wait_for(lambda: coord._behind == 0, 10), (coord._behind, coord._pending, coord._repush_at)
        assert "drafter_rollout_behind" in "".join(capfd.readouterr())
        time.sleep(1.5)
        assert pushes == [9] and coord.serving_version == 9
        assert "drafter_rollout_behind" not in "".join(capfd.readouterr())  # once, not at every event
        _idle(pub, -1)  # an n-gram rollout has no drafter to replace: nothing said
        time.sleep(1.5)
        assert pushes == [9] and "drafter_rollout_behind" not in "".join(capfd.readouterr())
    finally:
        coord.close()
        pub.close()


def test_a_checkpoint_of_another_init_drafter_is_moved_aside(tmp_path, model_dir, capfd) -> None:
    ckpt = tmp_path / "ckpt"
    base = dict(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(ckpt), gate_when_idle=False,
                eval_interval_s=1e9)
    # run 1: no init_drafter (random), under an n-gram rollout: its push of version 4 refused, kept as owed
    first = Coordinator(DrafterServiceConfig(**base), str(model_dir), None, None)
    with first._lock:
        first.candidate_version = 4
        first._pending = (own_tensors(first.candidate), 4)
    first.save_now()
    _unstarted(first)
    (ckpt / "worker-0.pt").write_bytes(b"a worker's optimizer state")
    # run 2: the user's warm-up drafter, on the rollout and as init_drafter, same checkpoint_dir
    warm = tmp_path / "warm"
    new_drafter(str(model_dir), seed=7).save(warm)
    pushes: list[int] = []
    cfg = DrafterServiceConfig(**{**base, "init_drafter": str(warm)})
    coord = Coordinator(cfg, str(model_dir), None, lambda t, v: pushes.append(v)).start()
    try:
        time.sleep(1.0)  # gate rounds: nothing owed
        assert pushes == [] and coord.serving_version == 0 and coord.candidate_version == 0
        from safetensors.torch import load_file

        want = load_file(str(warm / "model.safetensors"))
        assert all(torch.equal(v, want[k].to(v.dtype)) for k, v in coord.serving.items())
        aside = [p for p in ckpt.iterdir() if p.is_dir()]
        assert len(aside) == 1 and (aside[0] / "worker-0.pt").read_bytes() == b"a worker's optimizer state"
        old = load_state(aside[0] / "coordinator.pt")
        assert old is not None and old["candidate_version"] == 4 and old["pending"]["version"] == 4
        assert not (ckpt / "worker-0.pt").exists()
        err = capfd.readouterr()
        said = [line for line in (err.out + err.err).splitlines() if "drafter_checkpoint_other_lineage" in line]
        assert len(said) == 1 and "random" in said[0] and str(warm) in said[0] and aside[0].name in said[0], said
        coord.save_now()
    finally:
        coord.close()
    again = Coordinator(cfg, str(model_dir), None, None)  # the same init: its own checkpoint, restored
    try:
        assert [p for p in ckpt.iterdir() if p.is_dir()] == aside
        err = capfd.readouterr()
        assert "drafter_checkpoint_other_lineage" not in err.out + err.err
    finally:
        _unstarted(again)


def test_a_rollout_restarted_on_the_coordinators_init_drafter_gets_the_serving_one_again(tmp_path, model_dir,
                                                                                          monkeypatch, capfd) -> None:
    import tlt.services.drafter.coordinator_gate as coordinator_mod
    from tlt.model.drafter import folder_identity

    monkeypatch.setattr(coordinator_mod, "REPUSH_S", 0.5)
    init, other = tmp_path / "init", tmp_path / "other"
    new_drafter(str(model_dir), seed=3).save(init)
    new_drafter(str(model_dir), seed=4).save(other)
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(tmp_path / "ckpt"),
                               capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint,
                               eval_interval_s=1e9, init_drafter=str(init))
    pushes: list[tuple[int, dict]] = []
    coord = Coordinator(cfg, str(model_dir), None, lambda t, v: pushes.append((v, t))).start()
    try:
        assert coord.lineage == folder_identity(init) != folder_identity(other)
        trained = {k: v + 0.5 for k, v in coord.serving.items()}  # a drafter this service trained and pushed
        with coord._lock:
            coord.serving, coord.serving_version = trained, 5
        _idle(pub, 5, folder_identity(init))
        time.sleep(1.0)
        assert pushes == []  # the rollout serves it
        _idle(pub, 0, folder_identity(other))  # restarted on a drafter its operator chose: left alone, said once
        assert wait_for(lambda: coord._behind == 0, 10), (coord._behind, coord._pending)
        time.sleep(1.0)
        err = capfd.readouterr()
        assert pushes == [] and (err.out + err.err).count("drafter_rollout_behind") == 1, err
        assert folder_identity(other) in err.out + err.err
        _idle(pub, 0, folder_identity(init))  # restarted on the drafter this one grew from: pushed again
        assert wait_for(lambda: len(pushes) == 1, 10), pushes
        version, tensors = pushes[0]
        assert version == 5 and all(torch.equal(tensors[k], trained[k]) for k in trained)
        assert "drafter_repush" in "".join(capfd.readouterr())
        _idle(pub, 5, folder_identity(init))  # it took it
        time.sleep(1.5)
        assert len(pushes) == 1 and coord.serving_version == 5
    finally:
        coord.close()
        pub.close()


def test_a_checkpoint_written_before_lineages_were_recorded_is_kept(tmp_path, model_dir, capfd) -> None:
    """A coordinator.pt of a version that recorded no lineage, restored under a configured init_drafter (a learned
    drafter, not "random"): taken as of that init and restored, not moved aside as another lineage's."""
    ckpt, warm = tmp_path / "ckpt", tmp_path / "warm"
    new_drafter(str(model_dir), seed=7).save(warm)
    cfg = DrafterServiceConfig(coordinator_bind="tcp://127.0.0.1:*", checkpoint_dir=str(ckpt), gate_when_idle=False,
                               eval_interval_s=1e9, init_drafter=str(warm))
    first = Coordinator(cfg, str(model_dir), None, None)
    with first._lock:
        first.candidate_version = 4
    first.save_now()
    _unstarted(first)
    state = load_state(ckpt / "coordinator.pt")
    assert state.pop("lineage").startswith("sha256:")  # as an older version wrote it: no lineage
    torch.save(state, ckpt / "coordinator.pt")
    again = Coordinator(cfg, str(model_dir), None, None)
    try:
        assert again.candidate_version == 4
        assert not [p for p in ckpt.iterdir() if p.is_dir()] and (ckpt / "coordinator.pt").is_file()
        err = capfd.readouterr()
        assert "drafter_checkpoint_other_lineage" not in err.out + err.err
    finally:
        _unstarted(again)


def _restarted_on_init(tmp_path, model_dir, publish):  # noqa: ANN001, ANN202
    """A publisher playing the rollout, and a coordinator (not started: the gate's rounds are called by hand) grown
    from an init drafter, serving a trained v5; returns (pub, coord, the init's identity, the trained tensors)."""
    from tlt.model.drafter import folder_identity

    init = tmp_path / "init"
    new_drafter(str(model_dir), seed=3).save(init)
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    coord = gated_coordinator(tmp_path, model_dir, publish, gate_when_idle=True, capacity_pub=pub.pub_endpoint,
                              capacity_snapshot=pub.snapshot_endpoint, init_drafter=str(init))
    trained = {k: v + 0.5 for k, v in coord.serving.items()}
    with coord._lock:
        coord.serving, coord.serving_version, coord.candidate_version = trained, 5, 5
    return pub, coord, folder_identity(init), trained


def _candidate_v6_wins(coord, monkeypatch) -> None:  # noqa: ANN001
    """Candidate v6, scored above the serving drafter at the next evaluation (the scores scripted)."""
    import tlt.services.drafter.coordinator_gate as gate

    with coord._lock:
        coord.candidate_version = 6
    scores = iter([(2.0, 10), (1.0, 10)])  # candidate, then serving
    monkeypatch.setattr(gate, "mean_accept_length", lambda *a, **k: next(scores))


def test_a_repush_refused_as_already_served_ends_and_one_done_is_not_sent_again_while_the_events_lag(
        tmp_path, model_dir) -> None:
    """The rollout restarted on the coordinator's init drafter: the serving v5 is owed again (`_repush_if_behind`).
    A rollout that refuses it as already served (it got v5 another way meanwhile) ends it: no renumbered push of the
    same weights as v6. And once it is done, the events that still say v0 (they lag the push) do not make it owed
    again before REPUSH_S: pushed once, not every gate round."""
    from tlt.services.rollout.client import WeightPushError

    pushes: list[int] = []
    refusals: list[int] = []  # the version the rollout says it serves, once per push; none left: taken

    def publish(tensors, version):  # noqa: ANN001
        pushes.append(version)
        if refusals:
            served = refusals.pop(0)
            raise WeightPushError(f"drafter v{version} refused: the replicas serve v{served}", served)

    pub, coord, start, _ = _restarted_on_init(tmp_path, model_dir, publish)
    try:
        _idle(pub, 0, start)  # restarted on the init drafter
        assert wait_for(lambda: coord.rollout.drafter_behind(5) == 0, 10)
        coord._repush_if_behind()
        assert coord._pending is not None and coord._pending[1] == 5
        refusals.append(5)
        coord.push_pending()
        assert pushes == [5] and coord._pending is None
        assert (coord.serving_version, coord.candidate_version) == (5, 5)
        coord._repush_if_behind()  # the next gate round: the events still say v0
        assert coord._pending is None and pushes == [5]
    finally:
        coord.close()
        pub.close()


def test_a_candidate_push_owed_when_the_rollout_restarts_stays_owed(tmp_path, model_dir, monkeypatch) -> None:
    """Candidate v6 won the gate and its push failed (it may have landed on some replicas): owed. The rollout then
    restarts on the init drafter. The push owed is v6, as it was; the serving v5 must not take its place."""
    pushes: list[int] = []

    def publish(tensors, version):  # noqa: ANN001
        pushes.append(version)
        if len(pushes) == 1:
            raise ConnectionError("rollout unavailable")

    pub, coord, start, trained = _restarted_on_init(tmp_path, model_dir, publish)
    try:
        _candidate_v6_wins(coord, monkeypatch)
        _idle(pub, 5, start)
        assert wait_for(coord.rollout.idle, 10)
        with pytest.raises(ConnectionError):
            coord.evaluate_and_publish()
        assert coord._pending is not None and coord._pending[1] == 6
        _idle(pub, 0, start)  # restarted on the init drafter
        assert wait_for(lambda: coord.rollout.drafter_behind(5) == 0, 10)
        coord._repush_if_behind()
        assert coord._pending is not None and coord._pending[1] == 6
        coord.push_pending()
        assert pushes == [6, 6] and coord.serving_version == 6
        assert not all(torch.equal(coord.serving[k], trained[k]) for k in trained)
    finally:
        coord.close()
        pub.close()


def test_a_candidate_just_published_is_not_pushed_again_while_the_events_lag(tmp_path, model_dir, monkeypatch) -> None:
    """Candidate v6 wins the gate and its push lands; the rollout's events say v5 for a moment more (they lag the
    push). That is not a rollout behind: v6 is not owed again before REPUSH_S."""
    pushes: list[int] = []
    pub, coord, start, _ = _restarted_on_init(tmp_path, model_dir, lambda t, v: pushes.append(v))
    try:
        _candidate_v6_wins(coord, monkeypatch)
        _idle(pub, 5, start)
        assert wait_for(lambda: coord.rollout.idle() and coord.rollout.drafter_behind(6) == 5, 10)
        assert coord.evaluate_and_publish().published and pushes == [6]
        coord._repush_if_behind()  # the next gate round, the events still at v5
        assert coord._pending is None and pushes == [6]
    finally:
        coord.close()
        pub.close()
