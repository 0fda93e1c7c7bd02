r"""The reward service: answer extraction, the math verifier, and a real gRPC server and client.

Servers run for real on 127.0.0.1 with an ephemeral port; the CLI test starts
`tlt reward serve` as a subprocess and stops it with SIGTERM (by its pid).
Some tests plug in a verifier of their own (slow, blocking or raising) to make
timing and failures deterministic; that is the server's extension point, not
a fake of any process boundary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tlt.services.reward.boxed import equivalent, last_boxed, normalize
from tlt.services.reward.client import RewardCallError, RewardClient, RewardUnavailableError
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.reward.verifiers import math_verifier
from tlt.task import generate_problems
from tlt.v1 import reward_pb2, reward_pb2_grpc

Req = reward_pb2.ScoreRequest


def _config(**kw: object) -> RewardConfig:
    return RewardConfig(**{"port": 0, "workers": 4, "grace_s": 1.0, **kw})


@pytest.fixture
def server() -> Iterator[RewardServer]:
    with RewardServer(_config()) as s:
        yield s


# ---- extraction and normalisation -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (r"The answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{x^{2}+\sqrt{y_{1}}}", r"x^{2}+\sqrt{y_{1}}"),
        (r"\boxed 7.", "7"),
        ("\\boxed\n{7}", "7"),  # TeX skips a newline after a command as it does a space
        (r"\fbox{3}", "3"),
        (r"\boxed{unclosed {", None),
        (r"\boxedfoo{3}", None),
        ("no box here", None),
    ],
)
def test_last_boxed(text: str, want: str | None) -> None:
    assert last_boxed(text) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac34", r"\frac{3}{4}"),
        (r"$x = 1,234$", "1234"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        (r"\text{Evelyn}", "evelyn"),
        (r"\mathrm{IV}.", "iv"),
        ("+5", "5"),
    ],
)
def test_normalize(raw: str, want: str) -> None:
    assert normalize(raw) == want


def test_equivalent_numbers_exactly() -> None:
    assert equivalent("0.5", r"\frac{1}{2}")
    assert equivalent("1/2", r"\tfrac{1}{2}")
    assert equivalent(r"-\frac{3}{4}", "-0.75")
    assert equivalent("007", "7")
    assert not equivalent("0.333", r"\frac{1}{3}")
    assert not equivalent("2x+2", "2(x+1)")  # no symbolic algebra, by design
    assert not equivalent("", "0")
    assert not equivalent("1/0", "0")


def test_latex_thousands_separator() -> None:
    r"""`1{,}000` is how LaTeX (and models trained on MATH-style solutions) write a thousands separator; only the
    bare `1,000` was recognised, so `\boxed{1{,}000}` was scored wrong against 1000."""
    assert normalize(r"1{,}000") == "1000"
    assert math_verifier("", r"so \boxed{1{,}234{,}567}.", "1234567")
    assert math_verifier("", r"\boxed{-1{,}000.5}", "-1000.5")
    assert math_verifier("", r"\boxed{\$1{,}000}", "1,000")
    assert not math_verifier("", r"\boxed{1{,}2}", "12")  # not a thousands group: a list, left as it is


def test_units_after_a_number_are_dropped() -> None:
    r"""`\boxed{12\text{ cm}}` normalised to `12cm` and was scored wrong against 12 (math-verify and the
    MATH `strip_string` drop such units); only a `\text{...}`/`\mbox{...}` of words after a plain number is a unit."""
    assert math_verifier("", r"\boxed{12\text{ cm}}", "12")
    assert math_verifier("", r"\boxed{5 \text{ dollars}}.", "5")
    assert math_verifier("", r"\boxed{865 \mbox{ inches}^2}", "865")
    assert math_verifier("", r"\boxed{\frac{1}{2}\text{ hours}}", "0.5")
    assert math_verifier("", r"\boxed{10}", r"10\text{ inches}")  # a reference with units too
    assert not math_verifier("", r"\boxed{5\text{ or }6}", "5")  # not a unit: something follows it
    assert not math_verifier("", r"\boxed{x\text{ cm}}", "x")  # only after a plain number
    assert not math_verifier("", r"\boxed{12\text{ cm}}", "13")


def test_unit_stripping_takes_linear_time_on_degenerate_completions() -> None:
    r"""Three `\s*` in a row after a `\text{unit}` backtracked cubically (1,600 spaces: 19 s for one item) and the
    unit-words pattern quadratically (34 kB of words: 4 s; 256 kB, the item limit, ~4 min), each holding a reward
    worker. Not a speed target: the bound is 10x above what linear patterns take even on a loaded CI machine."""
    import time

    cases = [(r"\boxed{5\text{ cm}" + " " * 1600 + ",}", "5"), (r"\boxed{5\text{" + "ab " * 30000 + "1}}", "5")]
    for completion, reference in cases:
        t = time.perf_counter()
        assert not math_verifier("", completion, reference)
        assert time.perf_counter() - t < 2.0
    assert math_verifier("", r"\boxed{5\text{ cm}" + " " * 1600 + "}", "5")  # whitespace after a unit is nothing
    assert math_verifier("", r"\boxed{5\text{ cm}^2 .}", "5") and not math_verifier("", r"\boxed{5\text{ .~}}", "5")


def test_command_words_are_not_cut_or_folded() -> None:
    r"""`\left`/`\right` were removed as substrings (`\leftarrow` == `\rightarrow`), a bare `\circ` (composition)
    as if a degree sign, and lower() folded command names (`\Delta` == `\delta`); `\boxed2` is a box in TeX."""
    assert not math_verifier("", r"\boxed{\leftarrow}", r"\rightarrow")
    assert not math_verifier("", r"\boxed{f \circ g}", "fg") and math_verifier("", r"\boxed{f\circ g}", r"f \circ g")
    assert not math_verifier("", r"\boxed{\Delta}", r"\delta") and math_verifier("", r"\boxed{\Delta}", r"\Delta")
    assert math_verifier("", r"\boxed{\left( 1, 2 \right)}", "(1,2)")  # the sizing commands still go
    assert math_verifier("", r"\boxed{\displaystyle\frac12}", "0.5")
    assert math_verifier("", r"\boxed{90^\circ}", "90") and math_verifier("", r"\boxed{\text{Yes}}", "yes")
    assert math_verifier("", r"so \boxed2.", "2") and last_boxed(r"\boxedfoo{2}") is None


def test_math_verifier_takes_the_whole_marked_answer() -> None:
    """The answer after `answer:` is the whole token, not its leading integer: `answer: 7.5` was scored
    correct against 7 (and wrong against 7.5)."""
    assert not math_verifier("", "answer: 7.5", "7")
    assert not math_verifier("", "answer: 7,5", "7")
    assert not math_verifier("", "answer: 7,000", "7")
    assert math_verifier("", "answer: 7,000", "7000")
    assert math_verifier("", "answer: 7.5", "7.5")
    assert math_verifier("", "answer: 1/2", "0.5")
    assert math_verifier("", "so the answer: 7.", "7")  # sentence punctuation after it is not part of it
    assert math_verifier("", "(answer: 7)", "7")
    assert math_verifier("", "answer: -7<|im_end|>", "-7")
    assert math_verifier("", "answer: 07", "7")
    assert not math_verifier("", "answer:", "7")
    assert not math_verifier("", "answer: seven", "7")
    assert not math_verifier("", "answer: \u0667", "7") and not math_verifier("", "answer: \uff17", "7")  # ٧, ７
    assert not math_verifier("", "\\boxed{\u0667}", "7") and not equivalent("\uff17/2", "3.5")  # ASCII digits only


def test_math_verifier_on_the_synthetic_task() -> None:
    probs = generate_problems(20, seed=3)
    for p in probs:
        assert math_verifier(p.prompt, p.solution, p.answer)
        wrong = str((int(p.answer) + 1) % 100)
        assert not math_verifier(p.prompt, p.solution.rsplit("answer:", 1)[0] + f"answer: {wrong}", p.answer)
    assert math_verifier("", "answer: 07", "7")
    assert not math_verifier("", "answer: 52x", "52")
    assert not math_verifier("", "I do not know", "52")
    assert math_verifier("", r"so the result is \boxed{52}", "52")
    assert not math_verifier("", r"answer: 52 but \boxed{51}", "52")  # the boxed answer wins
    assert math_verifier("", r"\boxed{\dfrac{1}{2}}", "0.5")


def test_math_verifier_survives_an_integer_too_long_for_int() -> None:
    """A degenerate completion `answer: 111...1` (over 4300 digits) made int() raise ValueError, so the server
    answered ok=false ("verifier failed") and the trainer failed the whole step on one sample."""
    long_ones = "1" * 5000
    assert not math_verifier("", "answer: " + long_ones, "7")
    assert math_verifier("", "answer: " + "0" * 5000 + "7", "7")  # zero padding still does not matter
    assert math_verifier("", "answer: -" + long_ones, "-" + long_ones)
    assert not math_verifier("", "answer: " + long_ones, "-" + long_ones)
    assert math_verifier("", "answer: -0", "0")
    with RewardServer(_config()) as s:
        out = _stub(s).Score(reward_pb2.ScoreBatchRequest(
            items=[Req(id="long", completion="answer: " + long_ones, reference="7")]), timeout=10).results
    assert (out[0].ok, out[0].correct, out[0].error) == (True, False, "")


# ---- the server -------------------------------------------------------------------------------


def _stub(s: RewardServer) -> reward_pb2_grpc.RewardStub:
    return reward_pb2_grpc.RewardStub(grpc.insecure_channel(s.address))


def test_score_batch_in_request_order(server: RewardServer) -> None:
    items = [
        Req(id="a", completion="1+1=02\nanswer: 02", reference="2"),
        Req(id="b", completion="answer: 3", reference="2"),
        Req(id="c", completion=r"\boxed{\frac{2}{4}}", reference=r"\frac{1}{2}"),
    ]
    out = _stub(server).Score(reward_pb2.ScoreBatchRequest(items=items), timeout=10).results
    assert [(r.id, r.ok, r.correct, r.reward) for r in out] == [
        ("a", True, True, 1.0),
        ("b", True, False, 0.0),
        ("c", True, True, 1.0),
    ]
    text = server.metrics.render().decode()
    assert 'tlt_reward_scored_total{correct="true"} 2.0' in text
    assert 'tlt_reward_scored_total{correct="false"} 1.0' in text
    assert "tlt_reward_score_seconds_count 3.0" in text


def test_metrics_over_http(server: RewardServer) -> None:
    import httpx

    _stub(server).Score(reward_pb2.ScoreBatchRequest(items=[Req(id="a", completion="answer: 1", reference="1")]))
    exporter = server.metrics.serve(0)
    try:
        body = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5).text
    finally:
        exporter.close()
    assert 'tlt_reward_scored_total{correct="true"} 1.0' in body
    assert "tlt_reward_inflight 0.0" in body


def test_malformed_items_get_ok_false_and_siblings_still_scored() -> None:
    with RewardServer(_config(max_item_bytes=1000)) as s:
        items = [
            Req(id="", completion="answer: 1", reference="1"),
            Req(id="big", completion="x" * 2000, reference="1"),
            Req(id="noref", completion="answer: 1"),
            Req(id="good", completion="answer: 1", reference="1"),
            Req(id="blankref", completion="answer: 1", reference=" \n\t"),  # whitespace is no reference either
        ]
        out = _stub(s).Score(reward_pb2.ScoreBatchRequest(items=items), timeout=10).results
        assert [r.ok for r in out] == [False, True, False, True, False]
        assert "no id" in out[0].error
        assert (out[1].reward, out[1].correct) == (0.0, False)  # over the limit by its completion: scored the minimum
        assert "no reference" in out[2].error and "no reference" in out[4].error
        assert out[3].correct and out[3].reward == 1.0
        text = s.metrics.render().decode()
        assert 'tlt_reward_errors_total{reason="missing_id"} 1.0' in text
        assert 'tlt_reward_errors_total{reason="missing_reference"} 2.0' in text
        assert "tlt_reward_oversized_total 1.0" in text


def test_item_size_limit_counts_the_metadata() -> None:
    """`ScoreRequest.metadata` (a data row's other columns) is part of the item: a huge map passed
    max_item_bytes, which counted prompt, completion and reference only. Its keys and values count now."""
    with RewardServer(_config(max_item_bytes=1000)) as s:
        items = [
            Req(id="big-value", completion="answer: 1", reference="1", metadata={"notes": "x" * 2000}),
            Req(id="big-key", completion="answer: 1", reference="1", metadata={"k" * 995: "v"}),
            Req(id="many", completion="answer: 1", reference="1", metadata={f"c{i:03d}": "é" for i in range(200)}),
            Req(id="small", completion="answer: 1", reference="1", metadata={"solution": "1", "source": "gsm8k"}),
        ]
        out = _stub(s).Score(reward_pb2.ScoreBatchRequest(items=items), timeout=10).results
        assert [(r.id, r.ok) for r in out] == [("big-value", False), ("big-key", True), ("many", False),
                                              ("small", True)], out
        assert "2006 bytes" in out[0].error and "over the limit of 1000" in out[0].error  # 1 + 5 + 2000
        # 1 + 995 + 1 of the row, then the completion's 9 tip it over: scored the minimum, unchecked (it was right)
        assert (out[1].reward, out[1].correct) == (0.0, False)
        assert "1201 bytes" in out[2].error  # 1 + 200 * (4 + 2): counted in UTF-8 bytes, as the text is
        assert out[3].correct
        text = s.metrics.render().decode()
        assert 'tlt_reward_errors_total{reason="oversized"} 2.0' in text and "tlt_reward_oversized_total 1.0" in text


def test_batch_and_message_limits() -> None:
    with RewardServer(_config(max_batch_items=2, max_message_bytes=4096, max_item_bytes=2048)) as s:
        stub = _stub(s)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(reward_pb2.ScoreBatchRequest(items=[Req(id=str(i), reference="1") for i in range(3)]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "split the batch" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(reward_pb2.ScoreBatchRequest(items=[Req(id="x", completion="y" * 10000)]), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with RewardClient(s.address, retries=3, backoff_s=0.01) as client:
            start = time.monotonic()
            with pytest.raises(RewardCallError, match="INVALID_ARGUMENT"):
                client.score([Req(id=str(i), reference="1") for i in range(3)])
            assert time.monotonic() - start < 1.0  # not retried
        full = [Req(id=k, completion="answer: 1", reference="1") for k in ("z", "y")]  # exactly max_batch_items
        ok = stub.Score(reward_pb2.ScoreBatchRequest(items=full), timeout=10)
        assert [(r.id, r.correct) for r in ok.results] == [("z", True), ("y", True)]  # the server still works


def test_an_item_limit_a_message_cannot_carry_is_refused() -> None:
    """An item over max_item_bytes by its completion is scored oversized_reward so the step goes on; one over
    max_message_bytes is refused by gRPC before the server sees it, and the trainer's step fails. With
    max_item_bytes at or over max_message_bytes (256 KiB against a lowered message limit) the items between the
    two were promised the first and got the second, so such a config is refused at load."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_item_bytes 4096 must be below max_message_bytes 4096"):
        _config(max_message_bytes=4096, max_item_bytes=4096)
    with pytest.raises(ValidationError, match="max_item_bytes 262144 must be below max_message_bytes 65536"):
        _config(max_message_bytes=64 << 10)
    with RewardServer(_config(max_message_bytes=4096, max_item_bytes=2048)) as s:
        big = _stub(s).Score(reward_pb2.ScoreBatchRequest(items=[Req(id="x", completion="y" * 3000, reference="1")]),
                             timeout=10).results[0]
        assert big.ok and (big.reward, big.correct) == (0.0, False)  # over the item limit: scored, unchecked
        with pytest.raises(grpc.RpcError) as e:  # over the message limit: never scored
            _stub(s).Score(reward_pb2.ScoreBatchRequest(items=[Req(id="x", completion="y" * 5000, reference="1")]),
                           timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_client_submit_and_stream(server: RewardServer) -> None:
    with RewardClient(server.address, concurrency=4, timeout_s=10, retries=1) as client:
        futures = [client.submit(Req(id=f"s{i}", completion=f"answer: {i}", reference="3")) for i in range(8)]
        results = [f.result(timeout=10) for f in futures]
        assert [r.correct for r in results] == [i == 3 for i in range(8)]

        def produce() -> Iterator[reward_pb2.ScoreRequest]:
            for i in range(20):
                if i % 5 == 0:
                    time.sleep(0.05)  # completions finish over time
                yield Req(id=f"t{i}", completion=f"answer: {i % 4}", reference="1")

        got = {r.id: r.correct for r in client.score_stream(produce())}
        assert got == {f"t{i}": i % 4 == 1 for i in range(20)}


def test_close_does_not_wait_out_a_stuck_call() -> None:
    """close() waited for every in-flight call to run through its timeouts and retries ((retries + 1) x timeout_s:
    90 s with the trainer's defaults), so a trainer exiting after a failed step or Ctrl-C hung on a stuck server."""
    release = threading.Event()

    def stuck(prompt: str, completion: str, reference: str) -> bool:
        return release.wait(30)

    with RewardServer(_config(), verifier=stuck) as s:
        try:
            client = RewardClient(s.address, concurrency=2, timeout_s=2, retries=2, backoff_s=0.01)
            futures = [client.submit(Req(id=f"s{i}", reference="1")) for i in range(4)]  # 2 in flight, 2 queued
            time.sleep(0.5)
            start = time.monotonic()
            client.close()
            assert time.monotonic() - start < 1.5
            for fut in futures:
                assert fut.cancelled() or isinstance(fut.exception(timeout=1), RewardUnavailableError)
            assert not [t for t in threading.enumerate() if t.name.startswith("reward-client")]
        finally:
            release.set()


def test_client_raises_unavailable_after_retries() -> None:
    with RewardClient("127.0.0.1:1", timeout_s=2, retries=2, backoff_s=0.01) as client:
        start = time.monotonic()
        with pytest.raises(RewardUnavailableError, match=r"127.0.0.1:1 unavailable .* after 3 attempts"):
            client.submit(Req(id="a", reference="1")).result(timeout=20)
        with pytest.raises(RewardUnavailableError, match="ScoreStream"):
            list(client.score_stream(iter([Req(id="a", reference="1")])))
        assert time.monotonic() - start < 15


def test_client_stream_stall_times_out() -> None:
    release = threading.Event()

    def stuck(prompt: str, completion: str, reference: str) -> bool:
        return release.wait(10)

    with RewardServer(_config(), verifier=stuck) as s:
        try:
            with RewardClient(s.address, timeout_s=0.3, retries=1, backoff_s=0.01) as client:
                start = time.monotonic()
                with pytest.raises(RewardUnavailableError, match="after 2 attempts.*DEADLINE_EXCEEDED"):
                    list(client.score_stream(iter([Req(id="a", reference="1")])))
                elapsed = time.monotonic() - start
                assert 0.6 <= elapsed < 5  # each attempt waited its own timeout
        finally:
            release.set()


def test_client_stream_survives_a_server_restart() -> None:
    gate = threading.Event()

    def gated(prompt: str, completion: str, reference: str) -> bool:
        if prompt == "wait":
            gate.wait(5)
        return True

    first = RewardServer(_config(), verifier=gated).start()
    port = first.port
    second: RewardServer | None = None
    items_sent = threading.Event()

    def produce() -> Iterator[reward_pb2.ScoreRequest]:
        yield Req(id="quick", reference="1")
        yield Req(id="held", prompt="wait", reference="1")
        items_sent.set()

    with RewardClient(f"127.0.0.1:{port}", timeout_s=10, retries=5, backoff_s=0.2) as client:
        stream = client.score_stream(produce())
        assert next(stream).id == "quick"
        assert items_sent.wait(5)
        first.stop(0)  # the held item is never answered by this server
        gate.set()
        second = RewardServer(_config(port=port)).start()
        try:
            rest = list(stream)
        finally:
            second.stop(0)
    assert [r.id for r in rest] == ["held"] and rest[0].ok


def test_client_stream_sends_items_read_after_a_reopen() -> None:
    """After a reopen, the broken attempt's request stream was still waiting for the next item and took it: that
    item went to the dead call and was only sent again when the stream stalled (`timeout_s`) or the source ended."""
    first = RewardServer(_config()).start()
    port = first.port
    go, got_late = threading.Event(), threading.Event()

    def produce() -> Iterator[reward_pb2.ScoreRequest]:
        yield Req(id="quick", reference="1")
        assert go.wait(10)
        yield Req(id="late", reference="1")
        got_late.wait(15)  # the rollout goes on: the source ends only once "late" is answered

    second: RewardServer | None = None
    with RewardClient(f"127.0.0.1:{port}", timeout_s=10, retries=5, backoff_s=0.05) as client:
        stream = client.score_stream(produce())
        assert next(stream).id == "quick"
        first.stop(0)  # the stream breaks and is reopened on the restarted server
        second = RewardServer(_config(port=port)).start()
        try:
            threading.Timer(1.0, go.set).start()  # "late" finishes after the reopen
            start = time.monotonic()
            late = next(stream)
            elapsed = time.monotonic() - start
            got_late.set()
            assert late.id == "late" and late.ok
            assert elapsed < 5, f"late answered after {elapsed:.1f}s"
            assert list(stream) == []
        finally:
            got_late.set()
            second.stop(0)


def test_cli_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    env = dict(os.environ, TLT_REWARD__WORKERS="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tlt.cli", "--log-json", "reward", "serve", "--port", "0", "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "server not ready in 60 s"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        with RewardClient(f"127.0.0.1:{info['port']}", timeout_s=10) as client:
            assert client.score([Req(id="a", completion="answer: 5", reference="5")])[0].reward == 1.0
        maps = Path(f"/proc/{proc.pid}/maps")
        if maps.exists():  # a math reward server needs no torch: importing it took 2.3 s of each start (session 39)
            assert "libtorch" not in maps.read_text(), "the reward server loaded torch"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        log = proc.stderr.read().decode() if proc.stderr else ""
        events = [json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")]
        assert "reward_serving" in events and "reward_stopping" in events and "reward_stopped" in events
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_bad_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tlt.cli", "reward", "serve", "--kind", "poetry", "--port", "0"],
        capture_output=True, timeout=60,
    )
    assert proc.returncode == 2
    assert b"unknown reward kind 'poetry'" in proc.stderr


def test_a_score_call_past_its_deadline_stops_scoring() -> None:
    """A `Score` batch kept being scored after its caller's deadline had passed. The client retries
    DEADLINE_EXCEEDED, so a server already too slow got the same batch again on top of the first: the load that
    made it slow grew with every retry. Items not begun by the time the call ends are now skipped."""
    scored = []

    def slow(prompt: str, completion: str, reference: str) -> bool:
        scored.append(reference)
        time.sleep(0.2)
        return True

    with RewardServer(_config(workers=1), verifier=slow) as s:
        with grpc.insecure_channel(s.address) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            items = [Req(id=f"i{k}", completion="1", reference=str(k)) for k in range(20)]
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(reward_pb2.ScoreBatchRequest(items=items), timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(4.5)  # all 20 would take 4 s on one worker
        assert len(scored) <= 4, scored


def test_an_escaped_brace_neither_opens_nor_closes_the_box() -> None:
    assert last_boxed(r"\boxed{a\}b}") == r"a\}b"  # `\}` is text: the box closes at the last brace
    assert last_boxed(r"\boxed{\{}") == r"\{"  # `\{` is text: the box closes at once
    assert last_boxed(r"\boxed{a\\}") == r"a\\"  # `\\` is one escaped backslash; the brace after it closes


def test_empty_answers_are_never_equivalent() -> None:
    assert not equivalent("", "")
    assert not equivalent("$ $", r"\text{}")  # both normalise to "": still no answer


def test_a_thousands_group_follows_one_to_three_digits() -> None:
    assert normalize("12,345") == "12345"
    assert normalize("1234,567") == "1234,567"  # not a thousands separator: left as it is
    assert not equivalent("1234,567", "1234567")


def test_an_item_exactly_at_max_item_bytes_is_scored() -> None:
    """The limit is the most an item may hold: a data row of exactly max_item_bytes is scored, one byte over is not."""
    from tlt.services.reward.server import RewardServicer

    servicer = RewardServicer(_config(max_item_bytes=16))
    try:
        at = servicer.score_one(Req(id="at", prompt="p" * 15, reference="1", completion=""))  # 16 bytes
        over = servicer.score_one(Req(id="over", prompt="p" * 16, reference="1", completion=""))
        assert at.ok and not at.correct, at
        assert not over.ok and "over the limit of 16" in over.error, over
    finally:
        servicer.pool.shutdown()


def test_each_serve_flag_reaches_the_config() -> None:
    """`tlt reward serve --workers 1` is how a function that is not thread-safe is served: the flag must count."""
    import argparse

    from tlt.services.reward import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.build_config(parser.parse_args(["--workers", "1", "--port", "0", "--host", "127.0.0.2"]))
    assert (config.workers, config.port, config.host, config.kind) == (1, 0, "127.0.0.2", "math")


def test_a_stream_whose_items_cannot_be_scored_ends_in_an_error_not_ok() -> None:
    """An item the server cannot take (its scoring pool is shut down, as in a stop) fails the stream: it never ends
    OK with the item unanswered, which a client reads as every item answered."""
    with RewardServer(_config()) as s:
        s.servicer.pool.shutdown()
        with pytest.raises(grpc.RpcError) as e:
            list(_stub(s).ScoreStream(iter([Req(id="a", completion="answer: 1", reference="1")]), timeout=10))
        assert "shut down" in (e.value.details() or ""), e.value
