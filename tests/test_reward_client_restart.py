"""The trainer's reward client across a reward server restart: calls to a server that refuses connections
(UNAVAILABLE) keep retrying, with exponential backoff, for `retry_window_s` (the trainer's
`reward_retry_window_s`, default 30 s) before the step fails. Before, 2 retries took about 0.3 s in all, so a
reward pod's restart failed the step (and the trainer Job, backoffLimit 0). A real `RewardServer` started late on
the port the client calls; real gRPC on 127.0.0.1.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from tlt.services.common.ports import free_port
from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest


def _start_late(port: int, after_s: float, servers: list) -> threading.Thread:
    def start() -> None:
        time.sleep(after_s)
        servers.append(RewardServer(RewardConfig(port=port, workers=1)).start())

    t = threading.Thread(target=start, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("stream", [False, True], ids=["Score", "ScoreStream"])
def test_a_server_that_comes_up_within_the_window_scores_the_call(stream) -> None:
    port = free_port()
    servers: list = []
    starter = _start_late(port, 1.5, servers)
    try:
        with RewardClient(f"127.0.0.1:{port}", timeout_s=5, retries=2, retry_window_s=10) as client:
            start = time.monotonic()
            item = Req(id="a", completion=r"\boxed{4}", reference="4")
            result = list(client.score_stream([item]))[0] if stream else client.score([item])[0]
            assert result.ok and result.reward == 1.0, result
            assert 1.0 < time.monotonic() - start < 8
    finally:
        starter.join(10)
        for s in servers:
            s.stop(0)


def test_without_a_window_the_retries_alone_bound_it() -> None:
    with RewardClient(f"127.0.0.1:{free_port()}", timeout_s=5, retries=2, retry_window_s=0) as client:
        start = time.monotonic()
        with pytest.raises(RewardUnavailableError, match="after 3 attempts"):
            client.score([Req(id="a", reference="1")])
        assert time.monotonic() - start < 2


def test_the_trainer_passes_its_window() -> None:
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.rewards import make_reward_source

    assert TrainerConfig.model_fields["reward_retry_window_s"].default == 30.0
    source = make_reward_source(TrainerConfig(reward="grpc", reward_address="127.0.0.1:9", reward_retry_window_s=12))
    try:
        assert source._client.retry_window_s == 12
    finally:
        source.close()


@pytest.mark.parametrize("stream", [False, True], ids=["Score", "ScoreStream"])
def test_the_window_runs_from_the_first_failure_not_the_last(stream) -> None:
    """retry_window_s = 1 against a port nobody listens on: the window is measured from the first failed attempt,
    so the call gives up once the next backoff would pass 1 s since then (after 0.1 + 0.2 + 0.4 s of backoff) and
    says how long it tried. Measured from the latest failure, the window never ran out while the backoff (at most
    2 s) fit in it: a stream to a dead server with the trainer's 30 s window retried for ever."""
    with RewardClient(f"127.0.0.1:{free_port()}", timeout_s=5, retries=0, retry_window_s=1.0) as client:
        start = time.monotonic()
        with pytest.raises(RewardUnavailableError, match="unreachable") as e:
            if stream:
                list(client.score_stream([Req(id="a", reference="1")]))
            else:
                client.score([Req(id="a", reference="1")])
        assert time.monotonic() - start < 3
    tried = float(re.search(r"tried for ([0-9.]+) s", str(e.value)).group(1))
    assert 0.6 <= tried <= 1.0, str(e.value)
