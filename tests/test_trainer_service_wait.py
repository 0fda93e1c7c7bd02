"""The trainer says what it waits for at start. `_Services.sync` waits up to connect_timeout_s (120 s) for the
reward server, then for each rollout server; a trainer started beside services still loading (compose), or given
a wrong address, sat silent that long each time. Now `waiting_for_service` names the service and address once it
is not up within WAIT_QUIET_S, and `service_ready` says when it came. Real gRPC on 127.0.0.1: the project's
reward server started late on a fixed free port, and the reward client's own wait."""

from __future__ import annotations

import threading
import time

import pytest

from tlt.services.common.ports import free_port
from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.trainer import loop


def _logged(capfd) -> str:  # noqa: ANN001
    out = capfd.readouterr()
    return out.err + out.out


def test_a_service_up_at_once_is_waited_for_silently(capfd) -> None:
    with RewardServer(RewardConfig(port=0, workers=1)) as s, RewardClient(s.address) as client:
        loop._wait_for("reward", s.address, client.wait_ready, 20)
    assert "waiting_for_service" not in _logged(capfd)


def test_a_service_that_comes_late_is_named_while_waited_for_and_when_it_comes(capfd, monkeypatch) -> None:
    monkeypatch.setattr(loop, "WAIT_QUIET_S", 0.5)
    port = free_port()
    address = f"127.0.0.1:{port}"
    servers: list[RewardServer] = []
    late = threading.Timer(2.0, lambda: servers.append(RewardServer(RewardConfig(port=port, workers=1)).start()))
    late.start()
    try:
        with RewardClient(address) as client:
            began = time.monotonic()
            loop._wait_for("reward", address, client.wait_ready, 30)
            waited = time.monotonic() - began
    finally:
        late.join()
        for s in servers:
            s.stop(0)
    logged = _logged(capfd)
    assert 1.5 < waited < 25, waited
    assert "waiting_for_service" in logged and f"address={address}" in logged and "service=reward" in logged
    assert "service_ready" in logged and logged.index("waiting_for_service") < logged.index("service_ready")


def test_a_service_that_never_comes_fails_with_the_waits_own_error_after_naming_it(capfd, monkeypatch) -> None:
    monkeypatch.setattr(loop, "WAIT_QUIET_S", 0.3)
    address = f"127.0.0.1:{free_port()}"  # nothing listens
    with RewardClient(address) as client, pytest.raises(RewardUnavailableError, match="not reachable within 2"):
        loop._wait_for("reward", address, client.wait_ready, 2)
    logged = _logged(capfd)
    assert "waiting_for_service" in logged and "service_ready" not in logged
