"""A drafter worker that survives its peers' failures and keeps training: a batch the coordinator cannot build,
refused deltas, a lost answer, a capacity snapshot or coordinator not there yet, its replica busy for long; and
that exits with the drafter service that started it. Real workers, coordinator and CapacityPublisher over ZeroMQ
on 127.0.0.1, on real target features of a tiny random Qwen2, from tests/drafter_helpers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from drafter_helpers import BUSY, IDLE, make, model_dir, running, samples, state, wait_for  # noqa: F401 (fixtures)
from tlt.services.common.events import CapacityPublisher
from tlt.services.common.zmq_auth import ZmqAuth
from tlt.services.drafter.worker import DrafterWorker


def test_a_worker_survives_a_batch_the_coordinator_cannot_build(tmp_path, model_dir, samples) -> None:
    """The coordinator answers a batch request with an error (here: two windows of different widths in the
    buffer, put there directly, as ingest now refuses them); the worker logs it, skips the batch and keeps
    going, instead of dying with every other worker that draws the same data. Real coordinator and worker
    over ZeroMQ on 127.0.0.1."""
    import dataclasses

    import numpy as np

    from tlt.services.drafter.packing import Sample

    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, eval_interval_s=1e9)
    h = coord.drafter_cfg.hidden_size
    poison = [Sample(f"p{w}", np.arange(5, 13, dtype=np.int32), np.zeros((8, w), np.float16), 1, 99)
              for w in (h, h + 1)]
    coord.buffer.add_samples(poison)  # the newest version: drawn first, and pack() cannot join them
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        state(pub, 0, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 10)  # it asked for a batch
        time.sleep(1.0)  # several refused batches
        assert thread.is_alive() and coord.candidate_version == 0
        coord.buffer.add_samples([dataclasses.replace(s, policy_version=100) for s in samples[3:]])  # newer data
        assert wait_for(lambda: coord.candidate_version > 0, 20)  # it trains on it
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20)
        assert coord.windows[0].micro_steps > 0 and thread.is_alive()
    finally:
        stop.set()
        state(pub, 0, BUSY)
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


def _log_reader(capfd):  # noqa: ANN001, ANN202
    """log_has(text): whether `text` was logged since the test began (capfd's reads, accumulated)."""
    logged: list[str] = []

    def log_has(text: str) -> bool:
        out = capfd.readouterr()
        logged.append(out.err + out.out)
        return text in "".join(logged)

    return log_has


def test_a_refused_delta_is_dropped_and_the_worker_trains_on(tmp_path, model_dir, samples, capfd) -> None:
    """The coordinator refuses a delta it cannot apply (here: non-finite, as from a diverged step; real
    training on features made non-finite by `feature_noise = inf`). The CoordinatorRefused ended the worker's
    run() and, as a `tlt drafter worker` process, the worker for good. It must log the refusal, drop the delta
    together with the optimizer state that produced it (back to its last checkpoint) and train on: once the
    features are sane again its next delta is taken. Real coordinator, worker and publisher on 127.0.0.1."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, submit_every=2, eval_interval_s=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.cfg = cfg.model_copy(update={"feature_noise": float("inf")})  # every step yields non-finite weights
    log_has = _log_reader(capfd)
    with running(worker, pub, coord) as thread:
        state(pub, 0, IDLE)
        assert wait_for(lambda: log_has("non-finite values"), 30), "the coordinator never refused a delta"
        time.sleep(0.5)
        assert thread.is_alive(), "a refused delta ended the worker's run()"
        assert log_has("delta_refused") and coord.candidate_version == 0
        st = coord.status()  # the operator sees it: status (total and per worker) and /metrics
        assert st.deltas_refused >= 1 and st.workers[0].deltas_refused >= 1  # (the worker may refuse more meanwhile)
        import re

        metric = re.search(r"^drafter_deltas_refused_total (\S+)$", coord.metrics.render().decode(), re.M)
        assert metric is not None and float(metric.group(1)) >= st.deltas_refused
        worker.cfg = cfg  # sane features again
        assert wait_for(lambda: coord.candidate_version > 0, 30)  # the next delta is taken
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20)
        assert coord.windows[0].micro_steps > 0 and thread.is_alive()


def test_a_refused_deferred_delta_is_dropped_and_the_worker_trains_on(tmp_path, model_dir, samples, capfd) -> None:
    """As above for a preempted window's delta, sent at the start of the next idle window (`_flush`): the
    refusal ended that window and run(). It must be dropped with its optimizer state (the next window starts
    from the last checkpoint, here none: a fresh optimizer) and the window train on; the next window's
    deferred delta, made from sane features, is taken."""
    pushes: list = []
    pub, cfg, coord = make(tmp_path, model_dir, samples, pushes, submit_every=1000, eval_interval_s=1e9)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.cfg = cfg.model_copy(update={"feature_noise": float("inf")})  # every step yields non-finite weights
    log_has = _log_reader(capfd)
    with running(worker, pub, coord) as thread:
        state(pub, 0, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 20)
        time.sleep(0.5)
        state(pub, 0, BUSY)  # preempted: its non-finite delta waits for the next idle window
        assert wait_for(lambda: len(coord.windows) == 1, 20) and coord.windows[0].micro_steps > 0
        assert not log_has("non-finite values")  # not sent yet
        worker.cfg = cfg  # sane features again
        state(pub, 0, IDLE)  # the next window sends it first: refused
        assert wait_for(lambda: log_has("non-finite values"), 20), "the coordinator never refused the delta"
        assert wait_for(lambda: coord.workers[0].training, 10), "a refused deferred delta ended the window"
        time.sleep(0.5)
        assert thread.is_alive() and log_has("delta_refused") and coord.candidate_version == 0
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 2, 20) and coord.windows[1].micro_steps > 0
        state(pub, 0, IDLE)  # the second window's delta is sent now, and taken
        assert wait_for(lambda: coord.candidate_version == 1, 20)


def test_a_delta_resent_after_a_lost_answer_is_applied_once(tmp_path, model_dir, samples) -> None:
    """A deferred delta whose answer does not come within the worker's timeout (a slow coordinator; here its
    lock is held longer than the timeout, as a long save or evaluation could) is kept and sent again at the
    next idle moment, but the coordinator had applied it: the candidate moved by the same change twice. The
    resend must answer with the version the first send made and change nothing; the worker's next, different
    delta is applied. Real coordinator and worker over ZeroMQ on 127.0.0.1."""
    import torch

    from tlt.services.drafter.coordinator import Coordinator
    from tlt.services.drafter.training import tensors_message
    from tlt.services.drafter.training import own_tensors
    from tlt.services.drafter.worker import CoordinatorUnavailable, _Deferred
    from tlt.v1 import drafter_pb2

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.client.timeout_s = 0.5
    try:
        base = own_tensors(coord.candidate)
        worker._deferred = _Deferred({k: v + 0.01 for k, v in base.items()}, base, 0, 5, [1.0], {})

        def slow() -> None:
            with coord._lock:
                time.sleep(1.5)

        holder = threading.Thread(target=slow)
        holder.start()
        time.sleep(0.1)
        with pytest.raises(CoordinatorUnavailable):
            worker._flush()
        holder.join()
        assert wait_for(lambda: coord.candidate_version == 1, 5)  # applied, after the worker gave up waiting
        assert worker._deferred is not None  # the worker cannot know: it sends it again
        worker._flush()
        assert worker._deferred is None and coord.candidate_version == 1 and coord.deltas == 1
        assert torch.allclose(coord.candidate.state_dict()["fc.weight"], base["fc.weight"] + 0.01)
        worker._deferred = _Deferred({k: v + 0.02 for k, v in base.items()}, base, 0, 5, [1.0], {})
        worker._flush()  # a new change from the same base: applied
        assert coord.candidate_version == 2
        assert torch.allclose(coord.candidate.state_dict()["fc.weight"], base["fc.weight"] + 0.03)
        coord.save_now()  # a coordinator restarted from its checkpoint knows it too
        again = Coordinator(cfg, str(model_dir), None, None)
        try:
            m, p = tensors_message({k: v + 0.02 - base[k] for k, v in base.items()}, 0)
            upd = drafter_pb2.DeltaUpdate(base_version=0, manifest=m, payload=p, micro_steps=5)
            assert again.apply_delta(upd, 0) == 2 and again.candidate_version == 2
        finally:  # never started: only its socket to close
            again.close_sockets()
    finally:
        worker.close()
        coord.close()
        pub.close()


def test_a_worker_waits_for_a_capacity_snapshot_instead_of_exiting(tmp_path, model_dir, samples, monkeypatch) -> None:
    """The worker's first act is a snapshot of every replica's state. A snapshot socket that answers garbage
    (a buggy peer) or not at all within 30 s (a rollout slower to start than the worker, or restarting) raised
    out of run(): a `tlt drafter worker` process exited for good and nothing restarts it. It must ask again
    until the rollout answers and then train as usual. Real ZeroMQ on 127.0.0.1: a raw REP socket answers
    garbage once, then the real CapacityPublisher comes up on the same endpoints."""
    import zmq

    from tlt.services.common.ports import free_port

    snap, capp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, capacity_pub=capp,
                           capacity_snapshot=snap, pin_cpus=False)
    ctx = zmq.Context()
    auth = ZmqAuth(ctx)  # the snapshot REP of a rollout with the token (zmq_auth.py)
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    auth.bind(rep, snap)
    from tlt.services.drafter import worker as worker_module

    stepped = threading.Event()  # BUSY is sent once a micro-step is done: sent earlier it abandons the first one

    def micro_step(*args, **kwargs):
        loss = real_step(*args, **kwargs)
        if loss is not None:
            stepped.set()
        return loss

    real_step = worker_module.micro_step
    monkeypatch.setattr(worker_module, "micro_step", micro_step)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    rollout = None
    try:
        assert rep.poll(10_000), "the worker never asked for a snapshot"
        rep.recv()
        rep.send(b"\xff not an envelope")
        rep.close()
        time.sleep(0.5)
        assert thread.is_alive(), "a garbage snapshot answer ended the worker's run()"
        rollout = CapacityPublisher(capp, snap, heartbeat_s=0.2)
        state(rollout, 0, IDLE)
        assert wait_for(lambda: 0 in coord.workers and coord.workers[0].training, 30)
        assert stepped.wait(30), "the worker trained no micro-step after the rollout came up"
        state(rollout, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20) and coord.windows[0].micro_steps > 0
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        if rollout is not None:
            rollout.close()
        auth.close()
        ctx.term()
        coord.close()
        pub.close()


def test_a_capacity_pub_that_never_speaks_is_named_in_the_silence_warning(tmp_path, model_dir, samples,
                                                                         capfd) -> None:
    """`capacity_pub` naming a socket that is not the rollout's PUB (a typo, the snapshot's neighbour port taken
    wrong) while `capacity_snapshot` is right: the snapshot answers, every heartbeat is missed, the worker's IDLE
    goes stale and it never trains again. The warning said only `capacity_feed_silent silent_s=...`, as for a
    rollout that froze, with nothing to say the endpoint was never heard. It now names capacity_pub and says no
    event has come through it. Real CapacityPublisher (its snapshot socket) and worker on 127.0.0.1; the wrong
    PUB endpoint is a free port nothing binds."""
    from tlt.services.common.ports import free_port

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9)
    for r in (0, 1):
        state(pub, r, IDLE)  # what the snapshot says
    wrong = f"tcp://127.0.0.1:{free_port()}"
    worker = DrafterWorker(cfg.model_copy(update={"capacity_pub": wrong}), str(model_dir), 0, 0, coord.endpoint)
    worker.stale_s = 1.0  # the publisher's heartbeats come every 0.2 s
    log_has = _log_reader(capfd)
    with running(worker, pub, coord):
        assert wait_for(lambda: log_has("capacity_feed_silent"), 20), "the worker never said its feed is silent"
        assert log_has(f"no event or heartbeat has come through capacity_pub {wrong}")
        assert not log_has("heartbeats (about one a second) stopped")


def test_a_worker_started_before_its_coordinator_waits_for_it(tmp_path, model_dir, samples) -> None:
    """A worker (re)started while its coordinator is down, e.g. being restarted after a kill -9, asks it hello
    first; no answer within the timeout raised out of run() and the `tlt drafter worker` process exited for good
    (nothing restarts it), although every later request of a worker waits for the coordinator and retries. It
    must ask again until the coordinator answers, then train. Real ZeroMQ on 127.0.0.1: the coordinator comes up
    on its endpoint after the worker has given up once."""
    from tlt.services.common.ports import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    cfg_kw = dict(capacity_pub=pub.pub_endpoint, capacity_snapshot=pub.snapshot_endpoint, coordinator_bind=endpoint,
                  checkpoint_dir=str(tmp_path / "ckpt"), window_tokens=64, batch_tokens=64, batch_rows=2,
                  eval_interval_s=1e9, pin_cpus=False)
    from tlt.services.drafter.config import DrafterServiceConfig
    from tlt.services.drafter.coordinator import Coordinator

    cfg = DrafterServiceConfig(**cfg_kw)
    state(pub, 0, BUSY)
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, endpoint)
    worker.client.timeout_s = 0.5
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    coord = None
    try:
        time.sleep(2.0)  # several hellos unanswered
        assert thread.is_alive(), "an unanswered hello ended the worker's run()"
        coord = Coordinator(cfg, str(model_dir), None, None).start()
        coord.buffer.add_samples(samples)
        assert wait_for(lambda: 0 in coord.workers, 20)
        state(pub, 0, IDLE)
        assert wait_for(lambda: coord.workers[0].training, 20)
        time.sleep(1.0)  # some micro-steps: a BUSY right after the first batch request abandons the first step
        state(pub, 0, BUSY)
        assert wait_for(lambda: len(coord.windows) == 1, 20) and coord.windows[0].micro_steps > 0
    finally:
        stop.set()
        state(pub, 0, BUSY)
        thread.join(20)
        worker.close()
        if coord is not None:
            coord.close()
        pub.close()


def test_the_workers_of_a_killed_drafter_serve_exit_with_it(tmp_path, model_dir) -> None:
    """`tlt drafter serve` started its workers as plain children: killed with -9 (OOM killer, a crashed host
    process), it left them running, and the restarted service started a second worker for every replica, under
    the same ids and checkpoint files, training side by side on the same devices. A worker must exit with the
    process that started it (as services do with `tlt run`'s launcher); the restarted service starts new ones,
    which resume from the checkpoints, and at once: its clean stop waited ~20 s on the dead coordinator, long
    enough to join the restarted service's. Real processes: `tlt drafter serve --workers 1`, killed by its pid.
    The control token (set in the environment, as compose and `tlt run` do) never appears on a worker's command
    line, which every user of the host reads with `ps`: the workers got the service's config as `--config-json`."""
    import json

    from rollout_helpers import pid_gone

    secret = "tok-" + os.urandom(8).hex()  # the rollout's too: its capacity sockets are under it (zmq_auth.py)
    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2, token=secret)
    state(pub, 0, BUSY)
    ready = tmp_path / "ready.json"
    sets = {"capacity_pub": pub.pub_endpoint, "capacity_snapshot": pub.snapshot_endpoint,
            "features_bind": "tcp://127.0.0.1:*", "coordinator_bind": "tcp://127.0.0.1:*", "status_port": 0,
            "checkpoint_dir": str(tmp_path / "ckpt"), "pin_cpus": False, "coordinator_nice": 0,
            "worker_nice": 0}  # cpu-tiny's 19 starves the worker's start beside any other load
    cmd = [sys.executable, "-m", "tlt.cli", "drafter", "serve", "--model", str(model_dir), "--workers", "1",
           "--ready-file", str(ready)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        serve = subprocess.Popen(cmd, env={**os.environ, "TLT_DRAFTER__CONTROL_TOKEN": secret}, stdout=out,
                                 stderr=subprocess.STDOUT)
    worker = 0
    try:
        assert wait_for(lambda: ready.exists() or serve.poll() is not None, 90) and ready.exists()
        worker = json.loads(ready.read_text())["worker_pids"][0]
        assert wait_for(lambda: "worker_started" in log.read_text(), 60), log.read_text()[-2000:]
        assert not pid_gone(worker)
        # the variable that hands a worker its config is tlt's own: no worker warned of it as a misspelt one
        assert "unknown_environment" not in log.read_text(), log.read_text()[-2000:]
        argv = Path(f"/proc/{worker}/cmdline").read_bytes().decode()
        assert "drafter\x00worker" in argv and secret not in argv, argv
        assert secret in Path(f"/proc/{worker}/environ").read_bytes().decode()  # handed over, only to its own user
        state(pub, 0, IDLE)  # the worker is in a window (asking its coordinator for batches) when the service dies
        time.sleep(1.5)
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
        # at once: it waited 10 s for its dead coordinator to take the window's report, 10 s more for the final
        # flush, long enough to join the restarted service's new coordinator beside the new worker
        # 8 s: well under the ~20 s of the old wait, with room for a checkpoint being written on a loaded host
        assert wait_for(lambda: pid_gone(worker), 8), "a worker outlived its drafter service's kill -9"
        assert "worker_parent_gone" in log.read_text(), log.read_text()[-2000:]
    finally:
        if serve.poll() is None:
            serve.kill()
        if worker and not pid_gone(worker):
            os.kill(worker, signal.SIGKILL)
        pub.close()


def test_a_worker_whose_replica_stays_busy_is_still_reported_alive(tmp_path, model_dir, samples) -> None:
    """The coordinator reports a worker not heard from for `worker_silent_s` as dead (a kill -9). A worker whose
    replica is busy has nothing to ask the coordinator, and one in a long step or GetWeights fetch asks nothing
    either: its heartbeat thread says hello every `heartbeat_s` whatever the worker does (both shortened here).
    Once the worker has stopped it is reported dead. Real coordinator and worker over ZeroMQ on 127.0.0.1."""
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False)
    coord.worker_silent_s = 2.0
    worker = DrafterWorker(cfg, str(model_dir), 0, 0, coord.endpoint)
    worker.heartbeat_s = 0.2
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)

    def alive() -> bool:
        return any(w.worker_id == 0 and w.alive for w in coord.status().workers)

    try:
        thread.start()
        assert wait_for(alive, 20)
        for _ in range(8):  # 4 s of a busy replica: twice the silence that marks a worker dead
            time.sleep(0.5)
            assert alive()
        stop.set()
        thread.join(20)
        assert wait_for(lambda: not alive(), 10)
    finally:
        stop.set()
        thread.join(20)
        worker.close()
        coord.close()
        pub.close()


def test_a_worker_for_a_replica_the_rollout_lacks_says_so_once(tmp_path, model_dir, samples, monkeypatch) -> None:
    """`tlt drafter serve --workers 3` beside a rollout of 2 replicas started a worker for replica 2 that waited for
    its replica's IDLE forever, in silence. Once the other replicas' heartbeats have been heard for
    REPLICA_UNHEARD_S and its own never, it says so, once, with the fix; a worker whose replica is heard says
    nothing. Real CapacityPublisher (heartbeats every 0.2 s for replicas 0 and 1) and coordinator over ZeroMQ."""
    from tlt.services.drafter import worker as worker_mod

    said: list[dict] = []

    class _Log:
        def __getattr__(self, level):  # noqa: ANN001, ANN204
            return lambda event, **kw: said.append({"event": event, **kw}) if level == "warning" else None

    monkeypatch.setattr(worker_mod, "log", _Log())
    monkeypatch.setattr(worker_mod, "REPLICA_UNHEARD_S", 0.6)
    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False)
    lost = DrafterWorker(cfg, str(model_dir), 2, 2, coord.endpoint)
    found = DrafterWorker(cfg, str(model_dir), 1, 1, coord.endpoint)
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(stop,), daemon=True) for w in (lost, found)]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: any(s["event"] == "worker_replica_unknown" for s in said), 20)
        time.sleep(1.5)  # more heartbeats: still once
        unknown = [s for s in said if s["event"] == "worker_replica_unknown"]
        assert len(unknown) == 1 and unknown[0]["replica"] == 2 and unknown[0]["rollout_replicas"] == [0, 1]
        assert "--workers 2" in unknown[0]["hint"] and "never trains" in unknown[0]["hint"]
    finally:
        stop.set()
        for t in threads:
            t.join(20)
        lost.close()
        found.close()
        coord.close()
        pub.close()


def test_a_killed_worker_is_started_again_by_its_drafter_serve(tmp_path, model_dir) -> None:
    """A worker killed with -9 (the OOM killer, an operator) was never started again and nothing said so: the run
    went on with the rollout's idle time unused (a QA run: rc 0, no window trained after the kill). `tlt drafter
    serve` starts it again (it resumes from its checkpoint) and says so. Real processes: `tlt drafter serve
    --workers 1`, its worker killed by its pid."""
    import json

    from rollout_helpers import pid_gone

    def workers_of(parent: int) -> list[int]:
        found = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and b"drafter\x00worker" in (d / "cmdline").read_bytes():
                    if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(d.name))
            except OSError:
                continue
        return found

    pub = CapacityPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_s=0.2)
    state(pub, 0, BUSY)
    ready, log = tmp_path / "ready.json", tmp_path / "serve.log"
    sets = {"capacity_pub": pub.pub_endpoint, "capacity_snapshot": pub.snapshot_endpoint,
            "features_bind": "tcp://127.0.0.1:*", "coordinator_bind": "tcp://127.0.0.1:*", "status_port": 0,
            "checkpoint_dir": str(tmp_path / "ckpt"), "pin_cpus": False, "coordinator_nice": 0,
            "worker_nice": 0}  # cpu-tiny's 19 starves the worker's start beside any other load
    cmd = [sys.executable, "-m", "tlt.cli", "drafter", "serve", "--model", str(model_dir), "--workers", "1",
           "--ready-file", str(ready)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    with log.open("w") as out:
        serve = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: ready.exists() or serve.poll() is not None, 90) and ready.exists()
        first = json.loads(ready.read_text())["worker_pids"][0]
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: [p for p in workers_of(serve.pid) if p != first], 30), log.read_text()[-2000:]
        # the new worker is forked before its log line is written: wait for the line, not just the process
        assert wait_for(lambda: "worker_restarted" in log.read_text(), 10), log.read_text()[-2000:]
        assert serve.poll() is None
        again = [p for p in workers_of(serve.pid) if p != first]
        os.kill(again[0], signal.SIGTERM)  # stopped on purpose: it ends its window and exits 0, and stays stopped
        assert wait_for(lambda: pid_gone(again[0]), 30)
        time.sleep(2.5)  # more than two looks of the service
        assert workers_of(serve.pid) == [] and log.read_text().count("worker_restarted") == 1
        serve.terminate()
        serve.wait(60)
        assert wait_for(lambda: all(pid_gone(p) for p in again), 30)
    finally:
        if serve.poll() is None:
            serve.kill()
        pub.close()


def test_a_worker_joining_by_hand_is_known_by_the_id_it_was_given(tmp_path, model_dir, samples) -> None:
    """`tlt drafter worker --replica 0 --worker-id 3`, a worker joined by hand beside `tlt drafter serve`'s: the id
    names it to the coordinator (and its checkpoint, worker-3.pt); taken from --replica instead, it met the service's
    worker 0 under one id and one checkpoint file. A real worker process, coordinator and publisher on 127.0.0.1."""
    from tlt.services.drafter.serve import WORKER_CONFIG_ENV

    pub, cfg, coord = make(tmp_path, model_dir, samples, [], eval_interval_s=1e9, pin_cpus=False, worker_nice=0)
    cmd = [sys.executable, "-m", "tlt.cli", "drafter", "worker", "--model", str(model_dir), "--coordinator",
           coord.endpoint, "--replica", "0", "--worker-id", "3"]
    proc = subprocess.Popen(cmd, env={**os.environ, WORKER_CONFIG_ENV: cfg.model_dump_json()})
    try:
        assert wait_for(lambda: coord.workers, 60), "the worker never said hello"
        assert list(coord.workers) == [3] and coord.workers[3].replica_id == 0
    finally:
        proc.terminate()
        proc.wait(30)
        coord.close()
        pub.close()
