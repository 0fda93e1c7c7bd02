"""`tlt run`'s start-up order: the trainer starts with the services, not after them (its own ~9 s of start-up,
DeepSpeed and two models, overlaps the rollout's), and waits for them as for any server, for as long as the
launcher would. The services here are stand-in processes (a few lines of Python that write their ready file
when told to): what is under test is the launcher's ordering and its wait, not the services, which
tests/test_run_resume.py runs for real.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from test_run_plan import _closed, _fake_model, _plan

# A stand-in service: writes its ready file (the path after --ready-file) once `<ready file>.go` exists.
SERVICE = """
import json, os, sys, time
ready = sys.argv[sys.argv.index("--ready-file") + 1]
while not os.path.exists(ready + ".go"):
    time.sleep(0.05)
with open(ready + ".tmp", "w") as f:
    json.dump({"pid": os.getpid()}, f)
os.replace(ready + ".tmp", ready)
time.sleep(600)
"""

# A stand-in trainer: notes when it started and the connect timeout it was given, then exits with `code`
# (or waits to be stopped when code is 'wait').
TRAINER = """
import json, os, sys, time
out, code = sys.argv[1], sys.argv[2]
json.dump({"t": time.time(), "connect": os.environ.get("TLT_TRAINER__CONNECT_TIMEOUT_S")}, open(out, "w"))
if code == "wait":
    time.sleep(600)
if code == "kill":
    os.kill(os.getpid(), 9)
print("the stand-in trainer failed to start", flush=True)
sys.exit(int(code))
"""


def _launcher(tmp_path: Path, monkeypatch, trainer_code: str, *sets: str):  # noqa: ANN202 - Launcher
    from tlt.services.trainer import launcher as launcher_mod

    model, runs = _fake_model(tmp_path)
    plan = _closed(_plan(runs, model, "--run-id", "r", "--set", "run.startup_timeout_s=60",
                         "--set", "trainer.connect_timeout_s=7", "--set", f"run.drafter_init={tmp_path / 'drafter'}",
                         *(a for x in sets for a in ("--set", x))))
    noted = tmp_path / "trainer.json"

    def command(*args: str) -> list[str]:
        if args[0] == "train":
            return [sys.executable, "-c", TRAINER, str(noted), trainer_code]
        return [sys.executable, "-c", SERVICE, *args]

    monkeypatch.setattr(launcher_mod, "tlt_command", command)
    monkeypatch.delenv("TLT_TRAINER__CONNECT_TIMEOUT_S", raising=False)
    return launcher_mod.Launcher(plan, quiet=True), noted


def test_the_trainer_starts_before_the_services_are_ready_and_waits_as_long_as_the_launcher(tmp_path, monkeypatch):
    """The trainer process is up while no service is ready yet; its connect timeout is the trainer's own (7 s)
    plus the launcher's start-up allowance (60 s), so a slow service start fails in the launcher, by name, not
    as 'rollout not reachable' in a trainer that began waiting earlier."""
    launcher, noted = _launcher(tmp_path, monkeypatch, "wait")
    try:
        started = launcher.start_services()
        launcher.trainer = launcher.start_trainer()
        deadline = time.monotonic() + 30
        while not noted.exists():
            assert time.monotonic() < deadline, "the stand-in trainer did not start"
            time.sleep(0.05)
        trainer = json.loads(noted.read_text())
        assert trainer["connect"] == "67.0"
        assert all(p.ready_info() is None for p in started)  # none was told to be ready yet
        time.sleep(0.3)
        go = time.time()
        for p in started:
            Path(str(p.ready_file) + ".go").touch()
        ready = launcher.wait_services(started)
        assert sorted(ready) == ["drafter", "reward", "rollout"]
        assert trainer["t"] < go
        pids = json.loads((launcher.plan.run_dir / "pids.json").read_text())
        assert pids["trainer"] == launcher.trainer.pid  # written once the services are up, the trainer in it
    finally:
        launcher.shutdown()


def test_a_trainer_that_dies_while_the_services_start_ends_the_wait_at_once(tmp_path, monkeypatch):
    """No service ever becomes ready here; the launcher would wait its 60 s for them, but the trainer's exit
    (a bad config, say) ends the wait within a poll, with the trainer's log."""
    from tlt.services.trainer.procs import ServiceError

    launcher, _ = _launcher(tmp_path, monkeypatch, "3")
    try:
        started = launcher.start_services()
        launcher.trainer = launcher.start_trainer()
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=r"trainer exited with code 3 while the services started(.|\n)*"
                                               r"stand-in trainer failed to start"):
            launcher.wait_services(started)
        assert time.monotonic() - t0 < 20
        assert all(p.alive() for p in started)  # shutdown's to stop, as after any failed start
    finally:
        launcher.shutdown()
    assert not any(p.alive() for p in started)


def test_the_callers_own_connect_timeout_is_kept(tmp_path, monkeypatch):
    launcher, noted = _launcher(tmp_path, monkeypatch, "0")
    monkeypatch.setenv("TLT_TRAINER__CONNECT_TIMEOUT_S", "5")
    try:
        p = launcher.start_trainer()
        p.proc.wait(30)
        assert json.loads(noted.read_text())["connect"] == "5"
    finally:
        launcher.shutdown()
    assert os.environ["TLT_TRAINER__CONNECT_TIMEOUT_S"] == "5"


def test_a_trainer_with_nothing_left_to_do_ends_the_wait_without_an_error(tmp_path, monkeypatch):
    """A trainer that exits 0 while the services start (a finished run resumed) is not a failed start: the wait
    ends, and watch() reports the trainer's exit as the run's."""
    launcher, _ = _launcher(tmp_path, monkeypatch, "0")
    try:
        started = launcher.start_services()
        launcher.trainer = launcher.start_trainer()
        t0 = time.monotonic()
        assert launcher.wait_services(started) == {}
        assert time.monotonic() - t0 < 20
        assert launcher.watch() == 0
    finally:
        launcher.shutdown()


def test_a_trainer_killed_while_the_services_start_ends_the_wait_at_once(tmp_path, monkeypatch):
    """A trainer killed by a signal (the OOM killer's -9) has no exit code of its own: its negative return code is
    a failure as much as a positive one, and ends the wait as at once."""
    from tlt.services.trainer.procs import ServiceError

    launcher, _ = _launcher(tmp_path, monkeypatch, "kill")
    try:
        started = launcher.start_services()
        launcher.trainer = launcher.start_trainer()
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match="trainer exited with code -9 while the services started"):
            launcher.wait_services(started)
        assert time.monotonic() - t0 < 20
    finally:
        launcher.shutdown()


@pytest.mark.parametrize("sets, workers", [((), "2"), (("run.drafter_workers=3",), "3")])
def test_the_drafter_service_starts_a_worker_per_rollout_replica_unless_told(tmp_path, monkeypatch, sets, workers):
    """[run] drafter_workers = 0 (the default): one drafter worker per rollout replica, each training in its
    replica's idle time; a number: that many."""
    launcher, _ = _launcher(tmp_path, monkeypatch, "0", "rollout.replicas=2", *sets)
    try:
        drafter = {p.name: p for p in launcher.start_services()}["drafter"]
        assert drafter.argv[drafter.argv.index("--workers") + 1] == workers
    finally:
        launcher.shutdown()


def test_shutdown_stops_the_trainer_first_and_the_services_in_reverse_order_of_need(tmp_path, monkeypatch):
    """The order procs.py states: the trainer, the client of every service, first; then the drafter, the rollout
    and the reward, the reverse of their start."""
    launcher, _ = _launcher(tmp_path, monkeypatch, "wait")
    stopped: list[str] = []
    launcher.start_services()
    launcher.trainer = launcher.start_trainer()
    for p in launcher.services:
        monkeypatch.setattr(p, "stop", lambda t, p=p, stop=p.stop: (stopped.append(p.name), stop(t))[1])
    launcher.shutdown()
    assert stopped == ["trainer", "drafter", "rollout", "reward"]


# A stand-in `tlt drafter warmup`: notes its arguments and makes its --out folder.
WARMUP = """
import json, os, sys
args = sys.argv[2:]
json.dump(args, open(sys.argv[1], "w"))
os.makedirs(args[args.index("--out") + 1])
"""


@pytest.mark.parametrize("sets, problems, epochs", [((), "1024", "40"),
                                                    (("run.drafter_warmup_problems=64", "run.drafter_warmup_epochs=3"),
                                                     "64", "3")])
def test_a_warmup_drafter_init_warms_up_on_the_run_s_problems_and_epochs(tmp_path, monkeypatch, sets, problems,
                                                                         epochs) -> None:
    """`[run] drafter_init = "warmup"` ran `tlt drafter warmup` on 32 problems x 2 epochs, which left the drafter
    where a random one is (held-out accept length 1.15 on the tiny model); the default is now what
    artifacts/drafter-tiny is built with (1,024 x 40, ~50 s on 2 cores), and the run's config can change it."""
    from tlt.services.trainer import launcher as launcher_mod

    model, runs = _fake_model(tmp_path)
    argv = ["--run-id", "w", "--set", "run.drafter_init=warmup"]
    for s in sets:
        argv += ["--set", s]
    plan = _closed(_plan(runs, model, *argv))
    seen = tmp_path / "warmup.json"
    monkeypatch.setattr(launcher_mod, "tlt_command", lambda *a: [sys.executable, "-c", WARMUP, str(seen), *a])
    launcher_mod.Launcher(plan, quiet=True).prepare_drafter()
    args = json.loads(seen.read_text())
    assert args[:2] == ["drafter", "warmup"]
    assert args[args.index("--problems") + 1] == problems and args[args.index("--epochs") + 1] == epochs
    assert (plan.run_dir / "drafter-init").is_dir() and not (plan.run_dir / "drafter-init.tmp").exists()
