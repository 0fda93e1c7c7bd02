"""What a drafter worker leaves behind when its replica turns busy, or its window fails (found by review).

- At release (BUSY seen -> device freed) the window still held the drafter's parameters and gradients through
  the last micro-step's loss record (its autograd graph), so `torch.cuda.empty_cache()` freed nothing of them.
- A window aborted by CoordinatorUnavailable was released inside the `except` block, whose traceback still held
  the window's frame (drafter, optimizer, the device copies of embed / lm_head).
- The change a preempted window deferred is sent when the next window opens; a BUSY during that send was not
  looked at: the worker still wrote the optimizer checkpoint and pulled the whole candidate on the busy replica's
  time (the in-window path already stopped, test_drafter_worker.py).
- One failed checkpoint write (a full disk) ended `run()`, so the worker process, for good.
- After a failed checkpoint write the optimizer state kept in memory was loaded by reference (load_state_dict keeps
  the tensors it is given on their device): the window's training changed it in place, and a refused delta went
  back to the very steps it should have dropped.

The worker and its training are real (a tiny checkpoint, `tests/drafter_helpers.py`); the coordinator is the
in-process stub of those helpers. There is no GPU here: a device name that answers startswith("cuda") takes the
worker's CUDA branch, and `torch.cuda.empty_cache` is replaced by a probe that counts what is still alive.
"""

from __future__ import annotations

import errno
import threading
import weakref

import pytest
import torch

import tlt.services.drafter.worker as wmod
from drafter_helpers import IDLE, StubbedWorker, model_dir  # noqa: F401
from tlt.services.drafter.training import load_state
from tlt.services.drafter.worker import CoordinatorUnavailable


class _CudaName(str):
    """"cpu" that says it is a CUDA device: the worker runs its empty_cache branch (a probe here)."""

    def startswith(self, prefix, *args):  # type: ignore[override]
        return prefix == "cuda" or str.startswith(self, prefix, *args)


def _full_disk_once(monkeypatch) -> list:  # noqa: ANN001
    """The worker's first checkpoint write fails as on a full disk, the later ones write; returns the writes tried."""
    real, calls = wmod.save_atomic, []

    def full_disk_once(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(wmod, "save_atomic", full_disk_once)
    return calls


def _track_drafters(monkeypatch) -> list:
    refs: list = []
    real = wmod.Drafter

    class Tracked(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            refs.append(weakref.ref(self))
            refs.extend(weakref.ref(p) for p in self.parameters())

    monkeypatch.setattr(wmod, "Drafter", Tracked)
    return refs


def test_nothing_of_the_drafter_is_alive_when_a_preempted_window_releases_the_device(tmp_path, model_dir, monkeypatch):
    stub = StubbedWorker(tmp_path, model_dir)
    w = stub.worker
    w.device = _CudaName("cpu")
    w.state, w._heard = IDLE, 1e18
    stub.busy_after = 2  # BUSY after the third batch request: micro-steps, then the release
    refs = _track_drafters(monkeypatch)
    alive_at_release = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_at_release.append(sum(r() is not None for r in refs)))
    res = w.window()
    assert res.preempted and res.micro_steps >= 1 and len(refs) > 1
    assert alive_at_release == [0]


def test_nothing_of_the_drafter_is_alive_when_a_window_fails_on_the_coordinator(tmp_path, model_dir, monkeypatch):
    stub = StubbedWorker(tmp_path, model_dir)
    w = stub.worker
    w.device = _CudaName("cpu")
    w.state, w._heard, w._idle_since = IDLE, 1e18, 0.0
    stub.snapshot = lambda timeout_s=2.0: []
    stub.busy_after = 100
    stub_ask, batches = stub.ask, []

    def ask(**body):
        if "batch_request" in body:
            batches.append(1)
            if len(batches) == 2:  # the coordinator restarting: the second batch request times out
                raise CoordinatorUnavailable("no answer")
        return stub_ask(**body)

    w.client.ask = ask
    refs = _track_drafters(monkeypatch)
    stop, alive = threading.Event(), []

    def probe():
        alive.append(sum(r() is not None for r in refs))
        stop.set()

    monkeypatch.setattr(torch.cuda, "empty_cache", probe)
    monkeypatch.setattr(wmod.time, "sleep", lambda s: None)
    w.run(stop)
    assert len(refs) > 1 and alive[:1] == [0]


def test_a_busy_during_the_window_opening_send_skips_the_checkpoint_and_the_pull(tmp_path, model_dir):
    stub = StubbedWorker(tmp_path, model_dir)
    w = stub.worker
    w.state, stub.busy_after = IDLE, 2
    res = w.window()  # preempted after 2 micro-steps: the change and the checkpoint wait
    assert res.preempted and w._deferred is not None and w._deferred.steps == 2 and load_state(w.ckpt) is None
    real_ask = stub.ask

    def ask(**body):
        reply = real_ask(**body)
        if "update" in body:
            stub.busy()  # the replica turns busy while the deferred change is on its way
        return reply

    w.client = type("Client", (), {"ask": staticmethod(ask), "shared_policy_version": 0, "shared_fetch_failures": 0})()
    w.state, stub.busy_after, stub.asks[:] = IDLE, 10**6, []
    res = w.window()
    assert res.preempted and res.micro_steps == 0
    assert stub.asks.count("update") == 1 and "pull" not in stub.asks and load_state(w.ckpt) is None
    assert w._deferred is not None and w._deferred.steps == 0  # sent; only the checkpoint still waits
    w.state = IDLE  # the next idle moment: the checkpoint, and no second copy of the change
    w._flush(stop_on_busy=True)
    assert load_state(w.ckpt) is not None and w._deferred is None and stub.asks.count("update") == 1


def test_a_checkpoint_that_cannot_be_written_is_retried_not_fatal(tmp_path, model_dir, monkeypatch):
    stub = StubbedWorker(tmp_path, model_dir, submit_every=2)
    w = stub.worker
    w.state, w._heard, w._idle_since = IDLE, 1e18, 0.0
    stub.snapshot = lambda timeout_s=2.0: []
    stub.busy_after = 100
    calls = _full_disk_once(monkeypatch)
    stop = threading.Event()
    timer = threading.Timer(3.0, stop.set)
    timer.start()
    try:
        w.run(stop)  # raised OSError before
    finally:
        timer.cancel()
    assert w.checkpoint_failures == 1 and len(calls) >= 2 and load_state(w.ckpt) is not None


def test_a_window_after_a_failed_checkpoint_trains_on_from_the_unsaved_optimizer_state(tmp_path, model_dir,
                                                                                      monkeypatch):
    """When the window-opening checkpoint could not be written, the window read the optimizer state from the
    (older, here missing) checkpoint file: the Adam moments of the deferred state, still in memory, were dropped,
    and the next write saved a state descended from the stale one."""
    stub = StubbedWorker(tmp_path, model_dir)
    w = stub.worker
    w.state, stub.busy_after = IDLE, 2
    w.window()  # 2 micro-steps, preempted: the change and the checkpoint wait
    deferred = w._deferred.opt_state
    assert deferred["state"]

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wmod, "save_atomic", full_disk)
    loaded = []
    real_make = wmod.make_optimizer

    def make(*a, **k):
        opt = real_make(*a, **k)
        real_load = opt.load_state_dict
        opt.load_state_dict = lambda sd: (loaded.append(wmod.cpu_copy(sd)), real_load(sd))[1]  # as it was loaded
        return opt

    monkeypatch.setattr(wmod, "make_optimizer", make)
    w.state, stub.busy_after = IDLE, 1
    w.window()
    assert w.checkpoint_failures >= 1 and loaded  # the deferred state, which the window's training left as it was:
    assert all(torch.equal(loaded[0]["state"][i][k], v) for i, s in deferred["state"].items() for k, v in s.items())


def test_a_window_reports_the_cpu_it_spent_after_busy_beside_the_wall_clock_release(tmp_path, model_dir, monkeypatch,
                                                                                   capfd):
    """release_ms is wall clock, BUSY published -> device freed. A worker at worker_nice 19 (cpu-tiny) on the cores of
    a busy CPU replica waits for spare cycles to reach its next checkpoint and to release: release_ms read up to 1.1 s
    (two spinning replicas) where DRAFTER.md promises a preemption costs the replica one stretch between checkpoints
    (the CPU the worker takes from it). The window log says that too: release_cpu_ms, the CPU time the worker spent
    from its last look at an idle replica to the release. A sleep stands in for the wait for the CPU here."""
    import time

    stub = StubbedWorker(tmp_path, model_dir)
    w = stub.worker
    w.state, stub.busy_after = IDLE, 1  # BUSY comes with the second batch: one micro-step, then the release
    real_own = wmod.own_tensors

    def starved(*a, **k):
        time.sleep(0.3)  # runnable, but the scheduler runs the busy replica
        return real_own(*a, **k)

    monkeypatch.setattr(wmod, "own_tensors", starved)
    res = w.window()
    assert res.preempted and res.micro_steps == 1
    assert res.released - res.busy_timestamp >= 0.3
    assert 0.0 <= res.release_cpu < 0.15, res.release_cpu
    line = next(x for x in capfd.readouterr().err.splitlines() if "training_window" in x)
    assert "release_cpu_ms=" in line and "release_ms=" in line, line


@pytest.mark.parametrize("writes_fail,refused_from,step", [(lambda n: True, 1, 2), (lambda n: n == 1, 2, 4)],
                         ids=["every-write-fails", "the-second-write-succeeds"])
def test_a_refused_delta_goes_back_to_the_last_saved_optimizer_state_as_it_was_saved(tmp_path, model_dir, monkeypatch,
                                                                                  writes_fail, refused_from, step):
    """submit_every = 2, a window of 6 micro-steps: its first delta is taken with the checkpoint write failing (a full
    disk), so the last saved optimizer state is the one kept in memory, Adam's step 2. Every refused delta must go back
    to exactly that: load_state_dict keeps the very tensors it is given on the same device, so the kept state trained
    on in place with the optimizer it was loaded into, and the second refusal went back to step 4, the moments of the
    refused steps included. When the next write succeeds (step 4) the file is the last saved state: the one in memory
    is dropped, or a refusal went back to step 2."""
    from tlt.services.drafter.coordinator_client import CoordinatorRefused

    stub = StubbedWorker(tmp_path, model_dir, submit_every=2)
    w, real_save, real_ask, writes = stub.worker, wmod.save_atomic, stub.ask, []

    def save(*a, **k):  # noqa: ANN002, ANN003, ANN202
        writes.append(1)
        if writes_fail(len(writes)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*a, **k)

    def ask(should_stop=None, **body):  # noqa: ANN001, ANN003, ANN202
        if "update" in body and stub.version >= refused_from:  # e.g. non-finite after a diverged step
            stub.asks.append("update")
            raise CoordinatorRefused("the delta holds non-finite values")
        return real_ask(should_stop, **body)

    monkeypatch.setattr(wmod, "save_atomic", save)
    stub.ask = ask  # the worker's client is the stub
    w.state, stub.busy_after = IDLE, 6
    res = w.window()
    assert res.micro_steps == 6 and stub.asks.count("update") == 3 and stub.version == refused_from
    assert w._deferred.steps == 0  # the refused steps are dropped; the optimizer state the window ends with:
    assert {int(s["step"]) for s in w._deferred.opt_state["state"].values()} == {step}


def test_a_checkpoint_an_always_window_could_not_write_is_written_at_the_next_idle_moment(tmp_path, model_dir,
                                                                                        monkeypatch):
    """train_when = always ends a window at its submission, which writes the optimizer checkpoint. A write that failed
    there (a full disk) must wait as any failed one does, for the next window's start: taken as written, nothing wrote
    it until the next submission, and a kill -9 meanwhile resumed from the older checkpoint."""
    stub = StubbedWorker(tmp_path, model_dir, train_when="always", submit_every=2)
    w, calls = stub.worker, _full_disk_once(monkeypatch)
    res = w.window()
    assert res.micro_steps == 2 and stub.version == 1 and w.checkpoint_failures == 1 and load_state(w.ckpt) is None
    assert w._deferred is not None and w._deferred.steps == 0  # sent; only the checkpoint waits
    w._flush()
    assert load_state(w.ckpt)["micro_steps"] == 2 and w._deferred is None


def test_the_release_cpu_runs_from_the_last_look_that_found_the_replica_idle(tmp_path, model_dir, monkeypatch):
    """release_cpu is the worker's CPU from its last look that found the replica idle to the device's release: the
    stretch of a micro-step between that look and the one that saw BUSY is the replica's time taken, and counts. (Each
    look, the one that saw BUSY included, restarting the count reported only the release itself.)"""
    import time

    stub = StubbedWorker(tmp_path, model_dir)

    def step(*a, should_stop=None, **k):  # noqa: ANN002, ANN003, ANN202
        assert not should_stop()  # idle: the last such look
        stub.busy()  # the replica turns busy while the step runs on
        t = time.process_time()
        while time.process_time() - t < 0.2:  # the rest of the stretch to the step's next checkpoint
            pass
        assert should_stop()  # that checkpoint sees BUSY: the step is given up
        return None

    monkeypatch.setattr(wmod, "micro_step", step)
    stub.worker.state, stub.busy_after = IDLE, 10**6
    res = stub.worker.window()
    assert res.preempted and res.abandoned and res.micro_steps == 0
    assert res.release_cpu >= 0.2, res.release_cpu
