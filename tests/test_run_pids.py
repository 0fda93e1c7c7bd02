"""pids.json after a restart: rollout replicas and drafter workers are restarted by their service (the rollout
front's pool, `tlt drafter serve`), not by the launcher that writes pids.json, so a restarted one's new pid is not
there. What pids.json gives for them instead is each service's process group (`process_groups`): the service
and every process it started, restarted ones included; `kill -- -<group>` reaches them all, where a listed
replica or worker pid may be dead or, worse, reused. The services here are stand-ins (test_run_startup.py's
launcher) whose drafter supervises one worker and starts it again when it dies, as `tlt drafter serve` does."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from test_run_startup import _launcher

# A stand-in supervisor: starts a worker, names it in its ready file (once `<ready>.go` exists), and starts a
# new one whenever it exits, noting each worker's pid in `<ready>.workers`.
SUPERVISOR = """
import json, os, subprocess, sys, time
ready = sys.argv[sys.argv.index("--ready-file") + 1]
def start():
    w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(ready + ".workers", "a") as f:
        f.write(f"{w.pid}\\n")
    return w
worker = start()
while not os.path.exists(ready + ".go"):
    time.sleep(0.05)
with open(ready + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "worker_pids": [worker.pid]}, f)
os.replace(ready + ".tmp", ready)
while True:
    if worker.poll() is not None:
        worker = start()
    time.sleep(0.05)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (its parent has not reaped it yet) has ended too
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:  # reaped meanwhile
        return True


def _wait(cond, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_pids_json_names_each_service_group_which_reaches_a_restarted_worker(tmp_path, monkeypatch):
    from tlt.services.trainer import launcher as launcher_mod

    launcher, _ = _launcher(tmp_path, monkeypatch, "wait")
    command = launcher_mod.tlt_command  # test_run_startup's stand-ins; the drafter becomes a supervisor
    monkeypatch.setattr(launcher_mod, "tlt_command", lambda *a: [sys.executable, "-c", SUPERVISOR, *a]
                        if a[:2] == ("drafter", "serve") else command(*a))
    try:
        started = launcher.start_services()
        launcher.trainer = launcher.start_trainer()
        for p in started:
            Path(str(p.ready_file) + ".go").touch()
        launcher.wait_services(started)
        assert "drafter" in launcher.ready, "the drafter stand-in did not start"
        pids = json.loads((launcher.plan.run_dir / "pids.json").read_text())
        groups = pids["process_groups"]
        assert sorted(groups) == ["drafter", "reward", "rollout", "trainer"]
        assert all(groups[p.name] == os.getpgid(p.pid) for p in launcher.services)  # each its own group
        assert os.getpgid(os.getpid()) not in groups.values()  # not the launcher's: a group kill spares it
        first = pids["drafter_workers"][0]
        workers = Path(str(launcher.services[2].ready_file) + ".workers")
        os.kill(first, signal.SIGKILL)  # the supervisor restarts it: a new pid, which pids.json does not list
        _wait(lambda: len(workers.read_text().split()) == 2)
        restarted = int(workers.read_text().split()[1])
        assert restarted != first and restarted not in pids["drafter_workers"]
        os.killpg(groups["drafter"], signal.SIGKILL)  # what pids.json says to signal reaches the restarted one
        _wait(lambda: _gone(restarted) and _gone(pids["drafter"]))
        assert all(not _gone(p.pid) for p in launcher.services if p.name != "drafter")  # and no other service
    finally:
        launcher.shutdown()
