"""`tlt reward serve --function module:function`: a user's TRL-style reward function behind tlt.v1.Reward.

The CLI tests start `tlt reward serve` for real (the module in a temp folder that is the server's working
directory, found there as `load_function` finds it) and score through the real `RewardClient` and the trainer's
`GrpcRewards`; the others run `RewardServer` in-process on 127.0.0.1 with real gRPC.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tlt.services.common.config import ConfigError, load_config
from tlt.services.common.ports import free_port
from tlt.services.reward.client import RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.trainer.rewards import GrpcRewards
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest

USER_REWARD = textwrap.dedent(
    '''
    """TRL style, by keyword: (completions, **kw); one-element lists from the reward server."""
    ANSWER = 42  # not callable


    def score(completions, **kw):
        assert all(len(v) == 1 for v in [completions, *kw.values()]), kw
        text, prompt, answer = completions[0], kw["prompts"][0], kw["answer"][0]
        assert kw["answers"] == [answer] and prompt == "q", kw
        if "boom" in text:
            raise ValueError("boom in the completion")
        if "skip" in text:
            return [None]
        bonus = 0.5 if kw.get("task") == ["add"] else 0.0  # a metadata column
        bonus += sum(kw.get("weights", [[]])[0])  # a JSON column, decoded
        bonus += 100 * (kw.get("info", [{}])[0] == {"k": None, "n": [1, "x"]})
        bonus += 1000 * (kw.get("solution") == ["42"])  # a text column that reads as JSON stays text
        bonus += 10000 * (kw.get("count") == [42] and type(kw["count"][0]) is int)  # a number column is a number
        return [(1.0 if text.strip().endswith(answer) else 0.0) + bonus]
    '''
)


def _tlt(*argv: str, cwd: Path, **kw: object) -> subprocess.Popen:
    # the module is found in the working directory (not on PYTHONPATH), as load_function allows
    return subprocess.Popen([sys.executable, "-m", "tlt.cli", *argv], cwd=cwd, text=True,
                            stderr=subprocess.PIPE, **kw)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_python")
    (root / "user_reward.py").write_text(USER_REWARD)
    ready = root / "ready.json"
    proc = _tlt("reward", "serve", "--function", "user_reward:score", "--port", "0", "--workers", "2",
                "--ready-file", str(ready), cwd=root, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not ready.exists():
            proc.kill()
            pytest.fail(f"tlt reward serve --function did not start: {proc.communicate(timeout=10)[1][-2000:]}")
        yield {"address": f"127.0.0.1:{json.loads(ready.read_text())['port']}", "root": root}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0


def test_the_served_function_scores_through_the_reward_client(served) -> None:
    with RewardClient(served["address"], timeout_s=10, retries=0) as client:
        right, wrong, plain = client.score([
            Req(id="a", prompt="q", completion="answer: 7", reference="7", metadata={"task": "add"}),
            Req(id="b", prompt="q", completion="answer: 8", reference="7", metadata={"task": "mul"}),
            Req(id="c", prompt="q", completion="answer: 7", reference="7"),
        ])
        streamed = {r.id: r for r in client.score_stream(
            Req(id=f"s{i}", prompt="q", completion=f"answer: {i}", reference="3") for i in range(5))}
    assert (right.ok, right.reward, right.correct) == (True, 1.5, True)
    assert (wrong.ok, wrong.reward, wrong.correct) == (True, 0.0, False)  # correct = reward > 0
    assert (plain.ok, plain.reward, plain.correct) == (True, 1.0, True)
    assert {k: r.reward for k, r in streamed.items()} == {"s0": 0, "s1": 0, "s2": 0, "s3": 1.0, "s4": 0}


def test_the_trainer_grpc_path_sends_columns_the_function_reads(served) -> None:
    """GrpcRewards sends a text column as is and any other value as JSON; the function gets the values back."""
    source = GrpcRewards(served["address"], concurrency=2, timeout_s=10, retries=0)
    try:
        batch = source.begin()
        batch.submit("k0", "q", "answer: 51", "51", extra={"task": "add", "weights": [0.25, 0.5]})
        batch.submit("k1", "q", "answer: 50", "51", extra={"task": "sub", "info": {"k": None, "n": [1, "x"]}})
        results = batch.results()
    finally:
        source.close()
    assert results["k0"].reward == pytest.approx(1.0 + 0.5 + 0.75) and results["k0"].correct
    assert results["k1"].reward == pytest.approx(100.0) and results["k1"].correct


def test_a_text_column_that_reads_as_json_arrives_as_text(served) -> None:
    """The map carries text; `json_metadata_keys` says which values are JSON, so "42" stays "42" and 42 stays 42."""
    source = GrpcRewards(served["address"], concurrency=2, timeout_s=10, retries=0)
    try:
        batch = source.begin()
        batch.submit("t", "q", "answer: 51", "51", extra={"solution": "42", "count": 42})
        batch.submit("f", "q", "answer: 51", "51", extra={"solution": 42, "count": "42"})  # the other way round
        results = batch.results()
    finally:
        source.close()
    assert results["t"].reward == pytest.approx(1.0 + 1000 + 10000)
    assert results["f"].reward == pytest.approx(1.0)


def test_a_function_returning_none_or_raising_answers_ok_false_naming_it(served) -> None:
    with RewardClient(served["address"], timeout_s=10, retries=0) as client:
        skipped, raised, fine = client.score([Req(id="n", prompt="q", completion="skip", reference="1"),
                                              Req(id="r", prompt="q", completion="boom", reference="1"),
                                              Req(id="f", prompt="q", completion="1", reference="1")])
    assert not skipped.ok and "user_reward:score" in skipped.error and "None" in skipped.error
    assert not raised.ok and "user_reward:score" in raised.error
    assert "ValueError: boom in the completion" in raised.error
    assert fine.ok and fine.reward == 1.0  # its siblings are scored


BROKEN_MODULES = {  # a module whose own code fails as it is imported: its file and line, not our importlib frames
    "syntax_reward": "def score(prompts, completions, **kw):\n    return [1.0 for c in completions\n",
    "needs_reward": "import no_such_dependency_of_it\n",
    "raises_reward": "LIMIT = 1\nLIMIT = LIMIT / 0\n",
}


@pytest.mark.parametrize("spec, says", [("no_such_reward_mod:f", "no module 'no_such_reward_mod'"),
                                        ("user_reward:ANSWER", "no callable 'ANSWER'"),
                                        ("syntax_reward:score", "syntax_reward.py:2: SyntaxError: '[' was never"),
                                        ("needs_reward:score", "needs_reward.py:1: ModuleNotFoundError: No module "
                                                               "named 'no_such_dependency_of_it'"),
                                        ("raises_reward:score", "raises_reward.py:2: ZeroDivisionError")])
def test_a_function_that_cannot_be_loaded_exits_2_with_one_line_before_binding(tmp_path, spec, says) -> None:
    (tmp_path / "user_reward.py").write_text(USER_REWARD)
    for name, text in BROKEN_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    ready = tmp_path / "ready.json"
    with socket.socket() as busy:  # loaded before the port is bound: the function is named, not the port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = _tlt("reward", "serve", "--function", spec, "--port", str(busy.getsockname()[1]),
                    "--ready-file", str(ready), cwd=tmp_path, stdout=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
    lines = (out + err).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], out + err
    assert not ready.exists()


def test_the_reward_section_selects_a_function(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "positional_reward.py").write_text(textwrap.dedent("""
        def length(prm, cmp, answer):  # positional (prompts, completions), as TRL calls one without `completions`
            return [len(c) - len(a) + (p == "") for p, c, a in zip(prm, cmp, answer)]
    """))
    preset = tmp_path / "r.toml"
    preset.write_text('[reward]\nkind = "python"\nfunction = "positional_reward:length"\nport = 0\n')
    config = load_config(RewardConfig, "reward", str(preset), {}, require_section=True)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
        long, short, no_reference = client.score([Req(id="a", completion="abcd", reference="x"),
                                                  Req(id="b", completion="a", reference="xyz"),
                                                  Req(id="c", prompt="q", completion="ab")])
    assert (long.reward, long.correct) == (4.0, True) and (short.reward, short.correct) == (-1.0, False)
    assert no_reference.ok and no_reference.reward == 2.0  # the function decides what a missing reference means


def test_the_function_and_its_kind_go_together(tmp_path) -> None:
    preset = tmp_path / "r.toml"
    preset.write_text('[reward]\nkind = "python"\n')
    with pytest.raises(ConfigError, match="function"):
        load_config(RewardConfig, "reward", str(preset), {}, require_section=True)
    preset.write_text('[reward]\nkind = "math"\nfunction = "m:f"\n')
    with pytest.raises(ConfigError, match="python"):
        load_config(RewardConfig, "reward", str(preset), {}, require_section=True)


def test_one_attempt_is_one_attempt() -> None:
    with RewardClient(f"127.0.0.1:{free_port()}", timeout_s=2, retries=0) as client:
        with pytest.raises(RewardUnavailableError, match="after 1 attempt:"):
            client.score([Req(id="a", reference="1")])
        with pytest.raises(RewardUnavailableError, match=r"after 1 attempt \("):
            list(client.score_stream([Req(id="a", reference="1")]))


def test_a_function_returning_a_bad_value_answers_ok_false(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "bad_reward.py").write_text(textwrap.dedent("""
        def bad(prompts, completions, **kw):
            return {"nan": [float("nan")], "two": [1.0, 2.0], "text": "1", "bool": [True]}[completions[0]]
    """))
    config = RewardConfig(kind="python", function="bad_reward:bad", port=0)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
        results = client.score([Req(id=k, completion=k, reference="1") for k in ("nan", "two", "text", "bool")])
        metrics = server.metrics.render().decode()
    assert [r.ok for r in results] == [False] * 4, results
    assert all("bad_reward:bad" in r.error for r in results), results
    # the function's fault, not a verifier's: the dashboard splits the two
    assert 'tlt_reward_errors_total{reason="function_error"} 4.0' in metrics and "verifier_error" not in metrics


def test_a_reward_beyond_a_32_bit_float_answers_ok_false(tmp_path, monkeypatch) -> None:
    # finite in Python, but the proto's reward is a 32-bit float: 1e39 went out as inf with ok=true
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "big_reward.py").write_text("def big(prompts, completions, **kw):\n    return [float(c) for c in completions]\n")
    config = RewardConfig(kind="python", function="big_reward:big", port=0)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
        results = client.score([Req(id=k, completion=k, reference="1") for k in ("1e39", "-1e39", "3e38")])
    assert [r.ok for r in results] == [False, False, True], results
    assert "a finite number (float32) is required" in results[0].error  # refused as the trainer refuses it
    assert results[2].reward == pytest.approx(3e38, rel=1e-6)


def test_a_key_listed_as_json_whose_value_is_not_json_is_that_items_error() -> None:
    from tlt.services.reward.function import FunctionScorer, ItemError

    def score(completions, **kw):  # noqa: ANN001, ANN003
        return [float(kw["n"][0])]

    scorer = FunctionScorer("inline:score", fn=score)
    assert scorer(Req(id="a", completion="x", metadata={"n": "3"}, json_metadata_keys=["n"])) == (3.0, True)
    assert scorer(Req(id="b", completion="x", metadata={"n": "3"})) == (3.0, True)  # text "3": float() reads it
    with pytest.raises(ItemError, match="'n' is listed in json_metadata_keys but is not JSON"):
        scorer(Req(id="c", completion="x", metadata={"n": "three"}, json_metadata_keys=["n"]))


def test_sigterm_during_a_call_that_never_returns_still_exits_0(tmp_path) -> None:
    """A SIGTERM while the user's function ran (a stuck call) logged reward_stopped after the grace, then the process
    stayed alive: the executor's worker thread is joined at interpreter exit. It now exits 0 after the grace, saying
    it abandoned the call."""
    import threading

    (tmp_path / "stuck.py").write_text("import time\n\ndef score(completions, **kw):\n    time.sleep(1000)\n")
    ready = tmp_path / "ready.json"
    proc = _tlt("--log-json", "reward", "serve", "--function", "stuck:score", "--port", "0", "--ready-file",
                str(ready), "--set", "grace_s=1", cwd=tmp_path, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"

        def call() -> None:
            try:
                with RewardClient(address, timeout_s=60, retries=0) as client:
                    client.score([Req(id="a", completion="x", reference="1")])
            except Exception:  # noqa: BLE001 - the server goes away under it: what this test wants
                pass

        threading.Thread(target=call, daemon=True).start()
        time.sleep(1.0)  # the call is in the function now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        events = [json.loads(line)["event"] for line in proc.stderr.read().splitlines() if line.startswith("{")]
        assert "reward_stopping" in events and "reward_calls_abandoned" in events, events
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
