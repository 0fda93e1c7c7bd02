"""The trainer's reward client spreads its calls over every address its target resolves to.

`deploy/k8s/reward.yaml` runs two reward replicas "scaled horizontally behind a Service", but the client multiplexes
every call on one HTTP/2 connection, and a ClusterIP Service balances connections, not calls: one replica scored
everything. The Service is headless now (DNS answers every pod) and the client's channel picks round robin over
what the name resolves to. Shown here with two real reward servers on 127.0.0.1 behind one `ipv4:` target (the
multi-address answer a headless Service's DNS gives); the manifest is checked too.

Real parts: two RewardServers (the math verifier) on loopback, the real RewardClient and its gRPC channel."""

from __future__ import annotations

from pathlib import Path

from tlt.services.reward.client import RewardClient
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.v1 import reward_pb2

REPO = Path(__file__).resolve().parents[1]


def _scored(server: RewardServer) -> float:
    return sum(sample.value for metric in server.metrics.registry.collect() for sample in metric.samples
               if sample.name.endswith("scored_total"))


def test_calls_are_spread_over_every_resolved_reward_server() -> None:
    config = RewardConfig(port=0, workers=2, grace_s=1.0)
    with RewardServer(config) as a, RewardServer(config) as b:
        target = f"ipv4:{a.address},{b.address}"
        with RewardClient(target, concurrency=4, timeout_s=30, retries=0) as client:
            for i in range(24):
                got = client.score([reward_pb2.ScoreRequest(id=f"c{i}", completion=r"\boxed{7}", reference="7")])
                assert got[0].ok and got[0].reward == 1.0
        served = (_scored(a), _scored(b))
    assert sum(served) == 24 and min(served) >= 6, served  # round robin: ~12 each (pick_first put all 24 on one)


def test_the_reward_service_of_the_kubernetes_manifests_is_headless() -> None:
    import yaml

    docs = list(yaml.safe_load_all((REPO / "deploy/k8s/reward.yaml").read_text()))
    service = next(d for d in docs if d and d["kind"] == "Service")
    assert service["spec"].get("clusterIP") == "None", service["spec"]
