"""The workers `tlt drafter serve` starts (services/drafter/serve.py worker_launch): one per replica, each with its
own worker id, the resolved config in their environment and not on their command line, and bound to die with the
service (no process is started: the argv and environment are what the service hands subprocess.Popen); and which of
its workers that ended the service starts again (`_restart_dead_workers`, over real processes that signals ended).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tlt.services.common.config import load_config
from tlt.services.drafter.config import DrafterServiceConfig
from tlt.services.drafter.serve import WORKER_CONFIG_ENV, worker_launch


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_worker_gets_its_replica_and_an_id_of_its_own() -> None:
    """Worker i trains in replica i's idle time under id i: under one id, the coordinator counted two workers as one
    and both wrote one checkpoint file (worker-0.pt)."""
    cfg = load_config(DrafterServiceConfig, "drafter", "cpu-tiny", {"control_token": "s3cret"}, environ={})
    cmds, env = worker_launch(cfg, "/models/m", "tcp://127.0.0.1:44705", range(3))
    assert [(_flag(c, "--replica"), _flag(c, "--worker-id")) for c in cmds] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert all(_flag(c, "--model") == "/models/m" and _flag(c, "--coordinator") == "tcp://127.0.0.1:44705"
               for c in cmds)
    assert not any("s3cret" in a for c in cmds for a in c)  # `ps` shows a command line to every user of the host
    assert DrafterServiceConfig.model_validate_json(env[WORKER_CONFIG_ENV]) == cfg
    assert env["TLT_DIE_WITH_PARENT"] == str(os.getpid())


def _default_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _ended_by(sig: int) -> subprocess.Popen:
    """A real process that `sig` ended, as the OOM killer (SIGKILL) or a stop (SIGTERM, Ctrl-C's SIGINT) ends one.
    Its SIGINT and SIGTERM are set to their defaults: a test run started in the background by a non-interactive shell
    (`make test &`, nohup) hands its children SIGINT ignored, and `sleep` then outlived the SIGINT by 30 s."""
    p = subprocess.Popen(["sleep", "30"], preexec_fn=_default_stop_signals)
    p.send_signal(sig)
    p.wait(10)
    return p


def test_a_worker_stopped_on_purpose_stays_stopped_and_one_killed_too_often_is_left_down() -> None:
    """`_restart_dead_workers`, one look of the service: a worker a SIGINT or SIGTERM ended (stopped on purpose, or
    while it started) stays stopped; a killed one is started again; one already restarted MAX_WORKER_RESTARTS times
    is left down, once and for good (a worker that keeps failing is not restarted forever)."""
    from tlt.services.drafter.serve import MAX_WORKER_RESTARTS, _restart_dead_workers

    cmd = [sys.executable, "-c", "pass"]  # what a restart starts here: exits 0 at once
    procs = [_ended_by(signal.SIGINT), _ended_by(signal.SIGTERM), _ended_by(signal.SIGKILL), _ended_by(signal.SIGKILL)]
    before, restarts = list(procs), [0, 0, 0, MAX_WORKER_RESTARTS]
    try:
        _restart_dead_workers(procs, [cmd] * 4, dict(os.environ), restarts, threading.Event())
        assert [p is q for p, q in zip(procs, before)] == [True, True, False, True]
        assert restarts == [0, 0, 1, MAX_WORKER_RESTARTS + 1]
        procs[2].wait(30)  # the restarted one exits 0, on purpose
        before = list(procs)
        _restart_dead_workers(procs, [cmd] * 4, dict(os.environ), restarts, threading.Event())  # the next look
        assert procs == before and restarts == [0, 0, 1, MAX_WORKER_RESTARTS + 1]  # the left-down one stays down
    finally:
        for p in procs:
            p.wait(30)


def test_a_drafter_push_carrying_the_targets_head_is_refused_before_it_is_sent() -> None:
    """The rollout publisher's last check: a drafter push never carries the target's embedding or lm_head (the rollout
    would take them as the drafter's own). Nothing is sent: no rollout listens at the address."""
    from tlt.services.drafter.serve import rollout_publisher

    publish = rollout_publisher("127.0.0.1:9", "")
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        with pytest.raises(AssertionError, match=name):
            publish({"fc.weight": torch.zeros(2, 4), name: torch.zeros(3, 2)}, 1)
