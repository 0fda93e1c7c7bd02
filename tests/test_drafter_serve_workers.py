"""The workers `tlt drafter serve` starts (services/drafter/serve.py worker_launch): one per replica, each with its
own worker id, the resolved config in their environment and not on their command line, and bound to die with the
service. No process is started: the argv and environment are what the service hands subprocess.Popen.
"""

from __future__ import annotations

import os

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
