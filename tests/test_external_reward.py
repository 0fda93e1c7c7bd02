"""The trainer's gRPC reward path against a reward server written OUTSIDE the package.

The server is a separate Python process whose gRPC code is generated in a temp
folder from proto/tlt/v1/reward.proto alone (grpc_tools.protoc) plus a small
script written here. It never imports `tlt` (the test checks that the module
is absent from its sys.modules). Its rule is deliberately not the built-in
verifier's: reward = 0.25 * number of "x" in the completion, and it answers
ok=false for completions containing "refuse". Real gRPC on 127.0.0.1; nothing
faked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tlt.services.trainer.rewards import GrpcRewards, RewardError

REPO = Path(__file__).resolve().parents[1]

SERVER = textwrap.dedent(
    '''
    """An external reward service: generated stubs + 30 lines, no tlt import."""
    import sys
    from concurrent import futures

    import json

    import grpc

    from tlt.v1 import reward_pb2, reward_pb2_grpc  # generated into this folder, not the tlt package


    def score(item):
        if "refuse" in item.completion:
            return reward_pb2.ScoreResponse(id=item.id, ok=False, error="external rule refuses this one")
        # data set columns arrive as metadata: a text value as is, any other value as JSON
        bonus = len(item.metadata.get("name", "")) + sum(json.loads(item.metadata.get("weights", "[]")))
        return reward_pb2.ScoreResponse(id=item.id, ok=True, reward=0.25 * item.completion.count("x") + bonus,
                                        correct=item.completion.strip().endswith(item.reference))


    class Service(reward_pb2_grpc.RewardServicer):
        def Score(self, request, context):
            return reward_pb2.ScoreBatchResponse(results=[score(i) for i in request.items])

        def ScoreStream(self, request_iterator, context):
            for item in request_iterator:
                yield score(item)


    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    reward_pb2_grpc.add_RewardServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    import tlt
    leaked = sorted(m for m in sys.modules if m.startswith("tlt.") and not m.startswith("tlt.v1"))
    print(f"PORT {port} TLT_FROM {tlt.__file__} LEAKED {leaked}", flush=True)
    server.wait_for_termination()
    '''
)


@pytest.fixture(scope="module")
def external_server(tmp_path_factory):
    from grpc_tools import protoc

    root = tmp_path_factory.mktemp("external_reward")
    out = root / "gen"
    (out / "tlt" / "v1").mkdir(parents=True)
    # Only reward.proto: an external service needs nothing else from us.
    rc = protoc.main(["protoc", f"-I{REPO / 'proto'}", f"--python_out={out}", f"--grpc_python_out={out}",
                      str(REPO / "proto" / "tlt" / "v1" / "reward.proto")])
    assert rc == 0, "protoc failed"
    for pkg in (out / "tlt", out / "tlt" / "v1"):
        (pkg / "__init__.py").write_text("")
    script = root / "server.py"
    script.write_text(SERVER)
    # -I -S isolates the interpreter: no site module, so no site-packages and no editable-install
    # finder (the installed tlt is not importable); grpc and protobuf come from the venv's
    # site-packages folder added to sys.path explicitly, after the generated code.
    import grpc

    site = str(Path(grpc.__file__).resolve().parents[1])
    env = {"PATH": os.environ.get("PATH", "")}
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c",
                             f"import sys; sys.path[:0] = {[str(out), site]!r}; exec(open({str(script)!r}).read())"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT"):
            proc.kill()
            pytest.fail(f"external server did not start: {line!r} {proc.stderr.read()}")
        _, port, _, tlt_from, _, leaked = line.split(" ", 5)
        yield {"address": f"127.0.0.1:{port}", "leaked": leaked.strip(), "tlt_from": tlt_from, "gen": out}
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_external_server_does_not_import_tlt(external_server):
    # its `tlt` is the generated folder (only tlt.v1.reward_pb2*), not this project's package
    assert Path(external_server["tlt_from"]).resolve() == (external_server["gen"] / "tlt" / "__init__.py").resolve()
    assert external_server["leaked"] == "[]"


def test_trainer_reward_path_gets_external_rewards(external_server):
    source = GrpcRewards(external_server["address"], concurrency=4, timeout_s=10, retries=1)
    try:
        batch = source.begin()
        completions = {f"s0-p{i}-k{k}": ("x" * (i + k)) + f" answer: {i}" for i in range(3) for k in range(2)}
        for key, text in completions.items():  # submitted one by one, as a rollout stream would
            batch.submit(key, prompt="question", completion=text, answer=str(key[4]))
        results = batch.results()
        assert set(results) == set(completions)
        for key, text in completions.items():
            assert results[key].reward == pytest.approx(0.25 * text.count("x"))
            assert results[key].correct is True
    finally:
        source.close()


def test_data_set_columns_reach_the_external_server_as_metadata(external_server):
    # ScoreRequest.metadata (map<string, string>) carries a row's other columns: text as is, the rest as JSON
    source = GrpcRewards(external_server["address"], concurrency=2, timeout_s=10, retries=0)
    try:
        batch = source.begin()
        batch.submit("plain", "q", "xx", "1")
        batch.submit("cols", "q", "xx", "1", extra={"name": "abc", "weights": [0.5, 2], "meta": {"k": None}})
        results = batch.results()
    finally:
        source.close()
    assert results["plain"].reward == pytest.approx(0.5)
    assert results["cols"].reward == pytest.approx(0.5 + 3 + 2.5)  # len("abc") + sum([0.5, 2])


def test_refused_completion_fails_the_step_clearly(external_server):
    source = GrpcRewards(external_server["address"], concurrency=2, timeout_s=10, retries=0)
    try:
        batch = source.begin()
        batch.submit("good", "q", "xx", "1")
        batch.submit("bad", "q", "please refuse", "1")
        with pytest.raises(RewardError, match="could not score completion bad: external rule refuses this one"):
            batch.results()
    finally:
        source.close()


def test_unreachable_server_fails_after_retries():
    from tlt.services.common.ports import free_port

    # refused connections are retried for the window (a pod restarting), then the step fails
    source = GrpcRewards(f"127.0.0.1:{free_port()}", concurrency=1, timeout_s=1.0, retries=1, retry_window_s=2.0)
    try:
        batch = source.begin()
        batch.submit("only", "q", "x", "1")
        t0 = time.monotonic()
        with pytest.raises(RewardError, match="no reward for completion only: .*unavailable"):
            batch.results()
        assert 1.0 < time.monotonic() - t0 < 10
    finally:
        source.close()
