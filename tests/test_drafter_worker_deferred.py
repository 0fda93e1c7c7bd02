"""A drafter worker preempted at an exact point of its window (a micro-step, a delta's send, the shared
embedding / lm_head fetch): what it defers to its next idle moment (the delta, its optimizer checkpoint) and
that its optimizer state carries over windows and restarts. `StubbedWorker` (tests/drafter_helpers.py) replaces
a real worker's coordinator and capacity feed by in-process stubs so that BUSY lands at an exact micro-step;
the training is real, on a tiny random Qwen2."""

from __future__ import annotations

import pytest

from drafter_helpers import IDLE, StubbedWorker, model_dir  # noqa: F401 (fixtures)
from tlt.services.drafter.training import load_state


def test_optimizer_state_carries_over_preempted_windows(tmp_path, model_dir) -> None:
    """A preempted window defers its optimizer checkpoint to the next idle window; that window must train
    with it (Adam's moments and step count continue), not with the checkpoint from before the last window.
    A stub coordinator and event feed drive two windows of 3 and 2 micro-steps, preempted by BUSY."""
    stub = StubbedWorker(tmp_path, model_dir)
    worker = stub.worker
    for steps in (3, 2):
        worker.state, stub.busy_after = IDLE, steps
        res = worker.window()
        assert res.preempted and res.micro_steps == steps
    worker._flush()
    saved = load_state(worker.ckpt)
    assert saved["micro_steps"] == 5
    assert {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {5}


def test_busy_during_a_step_defers_the_due_submission(tmp_path, model_dir, monkeypatch) -> None:
    """BUSY arriving during the micro-step after which a submission is due: the worker stops there and
    defers the delta, checkpoint and re-pull (seconds of serialisation and disk on a real drafter) to its
    next idle window, as for any preemption, instead of doing them on the busy replica's time."""
    import tlt.services.drafter.worker as worker_mod

    stub = StubbedWorker(tmp_path, model_dir, submit_every=3)
    real, steps = worker_mod.micro_step, []

    def step(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real(*a, **k)
        steps.append(1)
        if len(steps) == 3:  # the replica turns busy while the 3rd step runs
            stub.busy()
        return out

    monkeypatch.setattr(worker_mod, "micro_step", step)
    stub.worker.state, stub.busy_after = IDLE, 10**6
    res = stub.worker.window()
    assert res.preempted and res.micro_steps == 3
    assert stub.asks == ["pull", "batch_request", "batch_request", "batch_request", "window"], stub.asks
    assert stub.worker._deferred is not None and stub.worker._deferred.steps == 3
    stub.worker._flush()  # the next idle moment sends all three steps
    assert stub.asks[-1] == "update" and stub.version == 1


def test_busy_during_a_forward_pass_abandons_the_step_before_its_backward(tmp_path, model_dir, monkeypatch) -> None:
    """BUSY arriving while a micro-step's forward pass runs: the worker asks after the loss and gives the step up
    (no backward pass, no update on the busy replica's time; a backward is ~60% of a step). The window counts
    the two finished steps, the optimizer has taken exactly two updates, and the deferred delta carries them."""
    import tlt.services.drafter.worker as worker_mod

    stub = StubbedWorker(tmp_path, model_dir)
    real, steps = worker_mod.micro_step, []

    def step(*a, should_stop=None, **k):  # noqa: ANN002, ANN003, ANN202
        steps.append(1)

        def stop() -> bool:
            if len(steps) == 3:  # the replica turns busy during the 3rd step's forward pass
                stub.busy()
            return should_stop()

        return real(*a, should_stop=stop, **k)

    monkeypatch.setattr(worker_mod, "micro_step", step)
    stub.worker.state, stub.busy_after = IDLE, 10**6
    res = stub.worker.window()
    assert len(steps) == 3 and res.preempted and res.micro_steps == 2 and res.abandoned == 1
    deferred = stub.worker._deferred
    assert deferred is not None and deferred.steps == 2
    assert {int(s["step"]) for s in deferred.opt_state["state"].values()} == {2}


def test_busy_during_a_delta_send_stops_before_the_checkpoint_and_the_pull(tmp_path, model_dir) -> None:
    """BUSY arriving while a window's due delta is being sent: the worker went on to write its optimizer
    checkpoint (twice the drafter's size: seconds on a real one) and to pull the whole candidate back, on the
    busy replica's time and with the drafter still on its device, before it looked at the events again. It
    must release the device right after the send and write the checkpoint at the next idle moment."""
    stub = StubbedWorker(tmp_path, model_dir, submit_every=2)
    real_ask = stub.ask

    def ask(**body):  # noqa: ANN003, ANN202
        reply = real_ask(**body)
        if "update" in body:
            stub.busy()  # the replica turns busy while the delta is on its way
        return reply

    stub.worker.client = type("Client", (), {"ask": staticmethod(ask), "shared_policy_version": 0,
                                             "shared_fetch_failures": 0})()
    stub.worker.state, stub.busy_after = IDLE, 10**6
    res = stub.worker.window()
    assert res.preempted and res.micro_steps == 2 and stub.version == 1
    assert stub.asks == ["pull", "batch_request", "batch_request", "update", "window"], stub.asks
    assert load_state(stub.worker.ckpt) is None  # not written on the busy replica's time
    assert stub.worker._deferred is not None and stub.worker._deferred.steps == 0  # only the checkpoint is due
    stub.worker._flush()  # the next idle moment
    saved = load_state(stub.worker.ckpt)
    assert saved["micro_steps"] == 2 and {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {2}
    assert stub.asks[-1] == "window" and stub.version == 1  # nothing sent twice


def test_a_restarted_worker_trains_with_its_configured_optimizer_settings(tmp_path, model_dir, monkeypatch) -> None:
    """A worker restarted with a new lr or weight_decay (`tlt drafter worker --set lr=...`, e.g. lowered after its
    deltas were refused as non-finite) trained on with the old ones: `load_state_dict` of its optimizer checkpoint
    brings back the saved param groups' lr, weight_decay and betas too. The checkpoint's moments and step counts
    carry over; the settings are the config's."""
    import tlt.services.drafter.worker as worker_mod

    real, seen = worker_mod.micro_step, []

    def step(drafter, opt, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        g = opt.param_groups[0]
        seen.append((g["lr"], g["weight_decay"], tuple(g["betas"])))
        return real(drafter, opt, *a, **k)

    monkeypatch.setattr(worker_mod, "micro_step", step)
    first = StubbedWorker(tmp_path, model_dir, lr=3e-3, weight_decay=0.0)
    first.worker.state, first.busy_after = IDLE, 2
    first.worker.window()
    first.worker._flush()
    again = StubbedWorker(tmp_path, model_dir, lr=3e-5, weight_decay=0.1)  # the restart, with new settings
    seen.clear()
    again.worker.state, again.busy_after = IDLE, 2
    again.worker.window()
    again.worker._flush()
    assert seen == [(3e-5, 0.1, (0.9, 0.95))] * 2, seen
    saved = load_state(again.worker.ckpt)
    assert {int(s["step"]) for s in saved["optimizer"]["state"].values()} == {4}  # Adam's state went on


def test_busy_during_the_shared_fetch_keeps_the_deferred_delta_for_later(tmp_path, model_dir) -> None:
    """A window opens by fetching a newer policy's embedding / lm_head (GetWeights: seconds on a real model), then
    sends what the last window deferred. A BUSY that came during the fetch was only looked at after the send, which
    ran on the busy replica's time. The window ends before the send, the delta still deferred; the next idle moment
    sends it. The fetch is a stand-in that queues the BUSY as the rollout would."""
    from tlt.services.drafter.shared import SharedTensors

    stub = StubbedWorker(tmp_path, model_dir)
    worker = stub.worker
    worker.state, stub.busy_after = IDLE, 2
    worker.window()  # 2 steps, preempted: delta and checkpoint deferred
    assert worker._deferred is not None and worker._deferred.steps == 2
    stub.asks.clear()

    def fetch() -> SharedTensors:
        stub.busy()  # the replica turns busy while the tensors come
        cur = worker.shared.current
        return SharedTensors(1, cur.embed.clone(), cur.lm_head.clone())

    worker.shared.fetch = fetch
    worker.shared.see(1)  # the capacity events said the rollout serves policy 1
    worker.state, stub.busy_after = IDLE, 10**6
    res = worker.window()
    assert res.preempted and res.micro_steps == 0 and stub.asks == ["window"], stub.asks
    assert worker.shared.current.policy_version == 1 and worker._deferred.steps == 2
    assert load_state(worker.ckpt) is None  # nor was the checkpoint written
    worker._flush()  # the next idle moment
    assert stub.asks[-1] == "update" and stub.version == 1 and load_state(worker.ckpt)["micro_steps"] == 2


def test_a_worker_checkpoint_of_another_model_is_named_in_the_error(tmp_path, model_dir) -> None:
    """A worker-<id>.pt written for another model (checkpoint_dir shared between models) failed at the first
    micro-step of the first idle window with "The size of tensor a (128) must match the size of tensor b (64)",
    a traceback that ended the worker's process. The worker refuses it when it starts, with a DrafterError (one
    line, exit 2 from the CLI) that names the file and says to give [drafter] checkpoint_dir another folder."""
    from tlt.model.drafter import DrafterError
    from tlt.model.testing import random_checkpoint

    first = StubbedWorker(tmp_path, model_dir)
    first.worker.state, first.busy_after = IDLE, 2
    first.worker.window()
    first.worker._flush()
    other = random_checkpoint(tmp_path / "other", hidden_size=32, intermediate_size=64)
    with pytest.raises(DrafterError) as err:
        StubbedWorker(tmp_path, other)
    msg = str(err.value)
    assert str(first.worker.ckpt) in msg and "checkpoint_dir" in msg and "\n" not in msg, msg


def test_each_delta_reports_the_mean_loss_of_its_own_steps(tmp_path, model_dir) -> None:
    """A window of 5 micro-steps with submit_every = 2, preempted after the fifth: the deltas sent in the window
    carry steps 1-2 and 3-4 and their mean losses, the deferred one (sent at the next idle moment) step 5 and its loss
    alone. The coordinator's loss curve is made of these means: the deferred delta read the whole window's, and the
    second delta sent in a window the mean of all its steps so far."""
    stub = StubbedWorker(tmp_path, model_dir, submit_every=2)
    sent = []
    ask = stub.ask

    def recording(should_stop=None, **body):  # noqa: ANN001, ANN003, ANN202
        if "update" in body:
            sent.append((body["update"].micro_steps, body["update"].mean_loss))
        return ask(should_stop, **body)

    stub.ask = recording  # the worker's client is the stub
    stub.worker.state, stub.busy_after = IDLE, 5
    res = stub.worker.window()
    assert res.preempted and res.micro_steps == 5
    stub.worker._flush()
    l1, l2, l3, l4, l5 = res.losses
    assert len({l1, l2, l3, l4, l5}) == 5
    assert sent == [(2, pytest.approx((l1 + l2) / 2)), (2, pytest.approx((l3 + l4) / 2)), (1, pytest.approx(l5))]


def test_the_window_report_carries_its_mean_loss_and_each_preemption_is_counted(tmp_path, model_dir) -> None:
    """Each preempted window is counted (the worker's checkpoint keeps the count over restarts), and its report to
    the coordinator (TrainingWindow, the training-window log) carries the mean of its micro-steps' losses."""
    stub = StubbedWorker(tmp_path, model_dir)
    windows = []
    ask = stub.ask

    def recording(should_stop=None, **body):  # noqa: ANN001, ANN003, ANN202
        if "window" in body:
            windows.append(body["window"])
        return ask(should_stop, **body)

    stub.ask = recording  # the worker's client is the stub
    losses = []
    for steps in (3, 2):
        stub.worker.state, stub.busy_after = IDLE, steps
        res = stub.worker.window()
        assert res.preempted and res.micro_steps == steps and len(set(res.losses)) == steps
        losses.append(sum(res.losses) / steps)
    assert [w.mean_loss for w in windows] == pytest.approx(losses)
    assert stub.worker.preemptions == 2
    stub.worker._flush()
    assert load_state(stub.worker.ckpt)["preemptions"] == 2


def test_a_feed_gone_silent_dates_the_stop_when_it_went_stale(tmp_path, model_dir) -> None:
    """An IDLE not heard again for stale_s ends the window as a BUSY would, dated when the feed went stale (last heard
    + stale_s), not when the worker noticed: the release latency it reports runs from there."""
    import time

    worker = StubbedWorker(tmp_path, model_dir).worker
    worker.state, worker.busy_seen, worker.stale_s = IDLE, False, 0.5
    worker._heard = time.monotonic() - 2.0  # heard 2 s ago: stale since 1.5 s ago
    worker._check_silence()
    assert worker.busy_seen and worker.last_busy == pytest.approx(time.time() - 1.5, abs=0.2)


def test_a_saved_optimizer_state_of_another_parameter_count_does_not_fit(tmp_path, model_dir) -> None:
    """A checkpoint's optimizer state for fewer parameters than this drafter has, each of those of the right shape, is
    not this drafter's: load_state_dict would refuse it at the first window, after the drafter is on the device. Nor
    is one whose moment of a 1-d parameter (a norm's weight, a bias) has another length."""
    from tlt.services.drafter.training import target_shared
    from tlt.services.drafter.worker_state import optimizer_misfit

    stub = StubbedWorker(tmp_path, model_dir)
    stub.worker.state, stub.busy_after = IDLE, 1
    stub.worker.window()
    stub.worker._flush()
    state = load_state(stub.worker.ckpt)["optimizer"]
    cfg, embed, head = target_shared(model_dir)
    assert optimizer_misfit(state, cfg, embed, head) is None
    n = len(state["param_groups"][0]["params"])
    i, moments = next((i, s) for i, s in state["state"].items() if s["exp_avg"].dim() == 1)  # a norm's weight
    h = moments["exp_avg"].shape[0]
    moments["exp_avg"] = moments["exp_avg"].new_zeros(h + 1)  # of another length: another model's
    assert optimizer_misfit(state, cfg, embed, head) == f"parameter {i} exp_avg: shape ({h + 1},), expected ({h},)"
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:-1]
    assert optimizer_misfit(state, cfg, embed, head) == f"{n - 1} parameters, expected {n}"


def test_a_restarted_worker_counts_on_from_its_checkpoints_steps_and_preemptions(tmp_path, model_dir) -> None:
    """A restarted worker (kill -9, `tlt drafter serve` starting it again) takes its micro-step and preemption counts
    from its checkpoint and counts on; counted from 0 again, its next checkpoint said it had trained 1 step and been
    preempted once, the earlier life forgotten."""
    first = StubbedWorker(tmp_path, model_dir)
    first.worker.state, first.busy_after = IDLE, 2
    first.worker.window()
    first.worker._flush()
    again = StubbedWorker(tmp_path, model_dir)  # the restart
    assert (again.worker.total_steps, again.worker.preemptions) == (2, 1)
    again.worker.state, again.busy_after = IDLE, 1
    again.worker.window()
    again.worker._flush()
    saved = load_state(again.worker.ckpt)
    assert (saved["micro_steps"], saved["preemptions"]) == (3, 2)


def test_a_refused_deferred_delta_is_sent_once(tmp_path, model_dir) -> None:
    """A preempted window's delta, refused when the next idle moment sends it, is dropped: kept, every later flush
    (each window's start after a failed one, the worker's exit) sent it again, refused again and counted again."""
    from tlt.services.drafter.coordinator_client import CoordinatorRefused

    stub = StubbedWorker(tmp_path, model_dir)
    real_ask = stub.ask

    def ask(should_stop=None, **body):  # noqa: ANN001, ANN003, ANN202
        if "update" in body:
            stub.asks.append("update")
            raise CoordinatorRefused("the delta holds non-finite values")
        return real_ask(should_stop, **body)

    stub.ask = ask  # the worker's client is the stub
    stub.worker.state, stub.busy_after = IDLE, 2
    stub.worker.window()
    assert stub.worker._deferred.steps == 2
    assert stub.worker._flush() is False and stub.worker._deferred is None
    stub.worker._flush()
    assert stub.asks.count("update") == 1 and load_state(stub.worker.ckpt) is None


def test_a_checkpoint_written_inside_a_window_counts_the_windows_steps(tmp_path, model_dir) -> None:
    """The checkpoint a submission writes inside a window counts the window's micro-steps so far (the worker's total
    is added to only when the window ends): without them a kill -9 before the window's end resumed counting from the
    window's start. submit_every = 2, preempted after 3 steps: the file says 2 before the next idle moment, 3 after."""
    stub = StubbedWorker(tmp_path, model_dir, submit_every=2)
    stub.worker.state, stub.busy_after = IDLE, 3
    assert stub.worker.window().micro_steps == 3
    assert load_state(stub.worker.ckpt)["micro_steps"] == 2
    stub.worker._flush()
    assert load_state(stub.worker.ckpt)["micro_steps"] == 3
