"""Container health checks: exit 0 when every named endpoint answers, 1 otherwise.

    python deploy/healthcheck.py http http://127.0.0.1:8000/health grpc-rollout 127.0.0.1:50051
    python deploy/healthcheck.py grpc-reward 127.0.0.1:50061
    python deploy/healthcheck.py grpc-drafter 127.0.0.1:50071
    python deploy/healthcheck.py http http://127.0.0.1:9460/metrics --when JOB_COMPLETION_INDEX=0

Used by docker-compose.yml and the Kubernetes probes. Checks are (kind,
target) pairs; each must answer within --timeout seconds. gRPC checks call a
read-only RPC of the service (Rollout.GetStatus, Reward.Score with an empty
batch, Drafter.GetStatus), so they prove the server is serving, not just
that the port is open. The reward server answers that empty batch UNAVAILABLE once more of its scoring threads
are stuck on items past `[reward] item_timeout_s` than it replaces (services/reward/pool.py), so the probe fails
then too.
No control-plane call is made, so no token is needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request


def check_http(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return None if r.status == 200 else f"{url}: HTTP {r.status}"
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {e}"


def check_grpc(kind: str, target: str, timeout: float) -> str | None:
    import grpc

    from tlt.v1 import drafter_pb2, drafter_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            if kind == "grpc-rollout":
                rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.StatusRequest(), timeout=timeout)
            elif kind == "grpc-reward":
                reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreBatchRequest(), timeout=timeout)
            else:
                drafter_pb2_grpc.DrafterStub(channel).GetStatus(drafter_pb2.DrafterStatusRequest(), timeout=timeout)
        except grpc.RpcError as e:
            return f"{kind} {target}: {e.code().name} {e.details()}"
    return None


KINDS = ("http", "grpc-rollout", "grpc-reward", "grpc-drafter")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", nargs="+", metavar="KIND TARGET", help=f"pairs; KIND is one of {', '.join(KINDS)}")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per check")
    parser.add_argument("--when", metavar="NAME=VALUE", default=None,
                        help="check only when environment variable NAME is VALUE, else exit 0 (the Kubernetes "
                        "trainer's pods share one probe, and only the pod of global rank 0 serves /metrics)")
    args = parser.parse_args(argv)
    if len(args.checks) % 2:
        parser.error("checks come in pairs: KIND TARGET")
    if args.when is not None:
        name, sep, value = args.when.partition("=")
        if not sep or not name:
            parser.error(f"--when takes NAME=VALUE, got {args.when!r}")
        if os.environ.get(name) != value:
            return 0
    failures = []
    for kind, target in zip(args.checks[::2], args.checks[1::2]):
        if kind not in KINDS:
            parser.error(f"unknown check kind {kind!r}; one of {KINDS}")
        problem = check_http(target, args.timeout) if kind == "http" else check_grpc(kind, target, args.timeout)
        if problem:
            failures.append(problem)
    for f in failures:
        print(f"unhealthy: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
