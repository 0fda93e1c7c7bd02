"""In-process reward functions (TRL contract) and the built-in reward server through the trainer's path.

Nothing is faked: the gRPC case runs the project's reward server on 127.0.0.1 (only the checks of bad
responses, which that server never sends, use a stand-in client that returns futures the test resolves).
"""

from __future__ import annotations

import argparse

import contextlib
import math
import threading
from concurrent.futures import InvalidStateError

import pytest

from tlt.services.trainer.rewards import (
    FunctionRewards,
    GrpcRewards,
    RewardError,
    RewardResult,
    load_function,
    task_rewards,
)


def length_reward(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def exact(prompts, completions, answer):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def test_weighted_sum_and_answer_kwargs():
    src = FunctionRewards([length_reward, exact], weights=[0.5, 2.0])
    batch = src.begin()
    batch.submit("a", "p", "42", "42")
    batch.submit("b", "p", "7", "8")
    res = batch.results()
    # a: 0.5 * 2 + 2.0 * 1 = 3.0; b: 0.5 * 1 + 0 = 0.5
    assert res["a"].reward == 3.0 and res["b"].reward == 0.5
    assert res["a"].correct and res["b"].correct  # > 0 counts as correct for plain functions


def test_task_verifier_source():
    batch = task_rewards().begin()
    batch.submit("right", "q", "3+4=7\nanswer: 7", "7")
    batch.submit("wrong", "q", "answer: 8", "7")
    res = batch.results()
    assert (res["right"].reward, res["right"].correct) == (1.0, True)
    assert (res["wrong"].reward, res["wrong"].correct) == (0.0, False)


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda prompts, completions, **kw: [1.0], "returned 1 values for 2 completions"),
        (lambda prompts, completions, **kw: [1.0, math.nan], "returned nan for completion k1"),
        (lambda prompts, completions, **kw: [1.0, "high"], "returned 'high'"),
        # past float32, where the step holds rewards: inf there, and NaN in every weight after one update
        (lambda prompts, completions, **kw: [0.0, 1e39], "returned 1e\\+39 for completion k1; a finite number"),
        # a mapping or a set: its keys, or an order of its own, were trained on as rewards
        (lambda prompts, completions, **kw: {0: 1.0, 1: 0.0}, "returned \\{0: 1.0, 1: 0.0\\}; a list of 2"),
        (lambda prompts, completions, **kw: {1.0, 0.0}, "; a list of 2 numbers is required"),
    ],
)
def test_bad_function_output_fails_clearly(fn, message):
    batch = FunctionRewards([fn]).begin()
    batch.submit("k0", "p", "c", "a")
    batch.submit("k1", "p", "c", "a")
    with pytest.raises(RewardError, match=message):
        batch.results()


def test_a_function_may_return_none_for_what_it_does_not_score_as_trl_allows():
    """TRL's multi-task convention: a reward function returns None for a completion it does not apply to (a math
    verifier on a code task), and the completion's reward is the weighted sum of the functions that did score it.
    TLT refused the step ("returned None ... a finite number is required"). A completion no function scored has no
    reward at all: TRL sums it to 0 with a warning; TLT refuses it, as it refuses every reward it cannot have."""
    def math_only(prompts, completions, task, **kw):
        return [1.0 if t == "math" else None for t in task]

    def code_only(prompts, completions, task, **kw):
        return [0.5 if t == "code" else None for t in task]

    batch = FunctionRewards([math_only, code_only], weights=[1.0, 2.0]).begin()
    batch.submit("m", "p", "c", "a", extra={"task": "math"})
    batch.submit("c", "p", "c", "a", extra={"task": "code"})
    res = batch.results()
    assert (res["m"].reward, res["c"].reward) == (1.0, 1.0)
    batch = FunctionRewards([math_only, code_only]).begin()
    batch.submit("m", "p", "c", "a", extra={"task": "math"})
    batch.submit("x", "p", "c", "a", extra={"task": "poetry"})
    with pytest.raises(RewardError, match=r"no reward function scored completion x.*math_only.*code_only"):
        batch.results()


def test_raising_or_shapeless_function_fails_with_reward_error():
    """A function that raised (on one completion: the call is batch-shaped) or returned None escaped as its own
    KeyError / TypeError ("object of type 'NoneType' has no len()"), not the RewardError naming the function."""

    def picky(prompts, completions, **kw):
        return [{"ok": 1.0}[c] for c in completions]

    _fails_naming_the_function(picky)
    none = FunctionRewards([lambda prompts, completions, **kw: None]).begin()
    none.submit("k0", "p", "c", "a")
    with pytest.raises(RewardError, match="returned None; a list of 1 numbers is required"):
        none.results()


def test_numpy_scores_are_numbers():
    """A TRL-style function that returns a numpy array's elements (np.float32, np.int64) is scored, not refused."""
    import numpy as np

    def scores(prompts, completions, **kw):
        return list(np.array([1.0, 0.25], dtype=np.float32))

    def counts(prompts, completions, **kw):
        return list(np.array([2, 0], dtype=np.int64))

    batch = FunctionRewards([scores, counts]).begin()
    batch.submit("k0", "p", "c", "a")
    batch.submit("k1", "p", "c", "a")
    res = batch.results()
    assert (res["k0"].reward, res["k1"].reward) == (3.0, 0.25)
    assert all(type(r.reward) is float for r in res.values())
    bad = FunctionRewards([lambda prompts, completions, **kw: [np.bool_(True), 1.0]]).begin()
    bad.submit("k0", "p", "c", "a")
    bad.submit("k1", "p", "c", "a")
    with pytest.raises(RewardError, match="returned"):
        bad.results()


def test_trl_keyword_functions():
    """TRL calls reward functions by keyword (prompts=, completions=, dataset columns), and its own and its docs'
    functions take `completions` first: `think_format_reward(completions, **kwargs)`. Called positionally as
    f(prompts, completions) they raised TypeError (or scored the prompts)."""

    def reward_len(completions, **kwargs):  # the TRL docs' example
        return [-abs(3 - len(c)) for c in completions]

    def mentions_prompt(completions, prompts, answer, **kwargs):  # a column, and prompts after completions
        return [float(p in c) + float(c.endswith(a)) for c, p, a in zip(completions, prompts, answer)]

    def positional_names(p, c, **kw):  # not TRL's names: still positional, as before
        return [float(len(c_)) for c_ in c]

    batch = FunctionRewards([reward_len, mentions_prompt, positional_names]).begin()
    batch.submit("a", "q1", "q1 is 7", "7")
    batch.submit("b", "q2", "no", "8")
    res = batch.results()
    # a: -4 + 2 + 7 = 5; b: -1 + 0 + 2 = 1
    assert (res["a"].reward, res["b"].reward) == (5.0, 1.0)


def test_extra_columns_reach_python_reward_functions_as_lists(tmp_path):
    """TRL passes every other column of the data set as a keyword list aligned with the completions: a function
    needing `solution` got only `answer`. Rows come from a real JSONL file; a row without a column gets None."""
    import json

    from tlt.services.trainer.data import load_prompts

    rows = [{"prompt": "1+1=", "answer": "2", "solution": "two", "difficulty": 1},
            {"prompt": "2+2=", "answer": "4", "solution": "four"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_prompts(data)
    seen = {}

    def by_solution(prompts, completions, solution, **kw):  # TRL's signature for a data set with 'solution'
        seen.update(kw, prompts=prompts, solution=solution)
        return [float(c == s) for c, s in zip(completions, solution)]

    def keyword_only(completions, solution):  # names the column, takes no **kw: gets that one only
        return [0.5 * (s in c) for c, s in zip(completions, solution)]

    batch = FunctionRewards([by_solution, keyword_only, exact, task_rewards()._fns[0][0]]).begin()
    texts = {0: ["two", "answer: 2"], 1: ["five", "four"]}  # n = 2 samples of each prompt
    for item in items:
        for k, text in enumerate(texts[item.index]):
            batch.submit(f"p{item.index}-k{k}", item.prompt, text, item.answer, extra=item.extra)
    res = batch.results()
    assert seen["solution"] == ["two", "two", "four", "four"]
    assert seen["difficulty"] == [1, 1, None, None]
    assert seen["answer"] == seen["answers"] == ["2", "2", "4", "4"] and seen["prompts"][2] == "2+2="
    # by_solution + keyword_only + exact (answer) + the task verifier (answers):
    #   p0-k0 "two": 1 + 0.5 + 0 + 0;  p0-k1 "answer: 2": 0 + 0 + 0 + 1;  p1-k0 "five": 0;  p1-k1 "four": 1 + 0.5
    assert {k: r.reward for k, r in res.items()} == {"p0-k0": 1.5, "p0-k1": 1.0, "p1-k0": 0.0, "p1-k1": 1.5}


def test_task_verifier_scores_an_integer_too_long_for_int():
    """`answer: 111...1` (over 4300 digits) made int() raise ValueError inside the built-in task reward, which
    failed the whole step on one degenerate sample instead of scoring it 0."""
    batch = task_rewards().begin()
    batch.submit("long", "q", "answer: " + "1" * 5000, "7")
    batch.submit("padded", "q", "answer: " + "0" * 5000 + "7", "7")
    res = batch.results()
    assert (res["long"].reward, res["padded"].reward) == (0.0, 1.0)


def test_load_function():
    assert load_function("tlt.task:reward").__name__ == "reward"
    with pytest.raises(ValueError, match="module:function"):
        load_function("tlt.task.reward")
    with pytest.raises(ValueError, match="no callable"):
        load_function("tlt.task:nope")


def test_a_reward_module_in_the_current_directory_is_found_without_pythonpath(tmp_path, monkeypatch):
    """`reward_function = "myreward:f"` with myreward.py in the directory `tlt train` runs from: the `tlt`
    script (unlike `python -m tlt.cli`) does not put that directory on sys.path, so the import failed with a
    ModuleNotFoundError traceback. The sys.path below is the script's: no cwd entry."""
    import os
    import sys

    (tmp_path / "tlt_test_cwd_reward.py").write_text(
        "def accuracy(completions, solution, **kw):\n"
        "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd())])
    monkeypatch.delitem(sys.modules, "tlt_test_cwd_reward", raising=False)
    try:
        fn = load_function("tlt_test_cwd_reward:accuracy")
    finally:
        sys.modules.pop("tlt_test_cwd_reward", None)
    assert fn(completions=["4", "5"], solution=["4", "4"]) == [1.0, 0.0]


def test_tlt_train_with_a_reward_module_it_cannot_find_ends_with_one_line_saying_where_it_looked(tmp_path,
                                                                                                random_model_dir):
    """A reward_function whose module is nowhere: `tlt train` (the real console script, run from tmp_path) ended
    in a ModuleNotFoundError traceback after loading the model; it now exits 2 before loading anything, with a
    message naming the module, the directory searched and PYTHONPATH. The rollout address is closed."""
    import subprocess
    import sys
    from pathlib import Path

    tlt = Path(sys.executable).with_name("tlt")
    assert tlt.is_file(), f"the project's console script {tlt} is missing: install the project (make test does)"
    r = subprocess.run([str(tlt), "train", "--config", "cpu-tiny", "--set", "reward=python",
                        "--set", "reward_function=no_such_reward_module:accuracy", "--set", "eval_problems=0",
                        "--set", f"model_dir={random_model_dir}",
                        "--set", 'rollout_addresses=["127.0.0.1:1"]', "--set", f"output_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "train_refused" in out, out[-2000:]
    assert "no_such_reward_module" in out and str(tmp_path) in out and "PYTHONPATH" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_builtin_reward_server_via_trainer_path():
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer

    cfg = RewardConfig(host="127.0.0.1", port=0)
    with RewardServer(cfg) as server:
        src = GrpcRewards(server.address, concurrency=4, timeout_s=10, retries=1)
        try:
            batch = src.begin()
            batch.submit("r", "q", "answer: 5", "5")
            batch.submit("w", "q", "answer: 6", "5")
            res = batch.results()
        finally:
            src.close()
    assert (res["r"].reward, res["r"].correct) == (1.0, True)
    assert (res["w"].reward, res["w"].correct) == (0.0, False)


def test_a_reward_server_that_is_down_fails_the_trainer_before_its_first_rollout(tmp_path):
    """Standalone `tlt train` with reward='grpc': a dead reward address is reported at start (naming it), not
    after a whole rollout was decoded and its first completion could not be scored. Real gRPC, no server."""
    import time

    from tlt.services.common.ports import free_port
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.loop import _Services

    dead = f"127.0.0.1:{free_port()}"
    cfg = TrainerConfig(reward="grpc", reward_address=dead, rollout_addresses=[f"127.0.0.1:{free_port()}"],
                        connect_timeout_s=0.5, output_dir=str(tmp_path))
    services = _Services(cfg, tmp_path, 0)
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardError, match=f"reward server {dead} not reachable"):
            services.sync(policy=None)  # the reward check comes first: no rollout, no policy needed
    finally:
        services.rewards.close()
    assert time.monotonic() - t0 < 5


def test_tlt_train_whose_reward_server_is_down_ends_with_one_line(tmp_path, random_model_dir, capfd):
    """`tlt train` run() reported a rollout failure as one line (train_failed, exit status 1) but let a reward failure
    end the trainer with a traceback. `tlt.cli.main` in this process; the reward and rollout addresses are closed."""
    from tlt.cli import main
    from tlt.services.common.ports import free_port

    dead = f"127.0.0.1:{free_port()}"
    rc = main(["train", "--config", "cpu-tiny", "--set", "reward=grpc", "--set", f"reward_address={dead}",
               "--set", "connect_timeout_s=0.5", "--set", "eval_problems=0", "--set", f"model_dir={random_model_dir}",
               "--set", f'rollout_addresses=["127.0.0.1:{free_port()}"]', "--set", f"output_dir={tmp_path / 'run'}"])
    out = capfd.readouterr()
    text = out.out + out.err
    assert rc == 1 and "train_failed" in text and f"reward server {dead} not reachable" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]


def test_tlt_train_shows_where_the_users_reward_function_raised(monkeypatch, capfd):
    """A reward function's exception ends `tlt train` with the one-line train_failed, and with the user's own
    traceback: the line of their code that raised is what they need to fix it."""
    from tlt.services.trainer import loop, train

    def judge(prompts, completions, **kw):
        return [{"4": 1.0}[c] for c in completions]  # KeyError on "5"

    def train_one_step(cfg):  # noqa: ANN001, ANN202 - the loop's scoring of one step, without a rollout
        batch = FunctionRewards([judge]).begin()
        batch.submit("k0", "2+2=", "5", "4")
        batch.results()

    monkeypatch.setattr(loop, "train", train_one_step)
    args = argparse.Namespace(config="cpu-tiny", overrides=[], print_config=False)
    assert train.run(args) == 1
    out = capfd.readouterr()
    text = out.out + out.err
    assert "train_failed" in text and "judge raised KeyError" in text, text[-2000:]
    assert "Traceback" in text and 'return [{"4": 1.0}[c] for c in completions]' in text, text[-2000:]


def test_wait_ready_returns_once_the_reward_server_is_up():
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer

    with RewardServer(RewardConfig(host="127.0.0.1", port=0)) as server:
        src = GrpcRewards(server.address, concurrency=2, timeout_s=5, retries=0)
        try:
            src.wait_ready(5.0)
        finally:
            src.close()


def test_a_generator_function_that_raises_fails_with_reward_error():
    """A reward function written as a generator (`yield` per completion) runs its code only when its values are
    read; reading them was outside the error boundary, so its exception escaped raw instead of as the
    RewardError that names the function."""

    def per_completion(prompts, completions, **kw):
        for c in completions:
            yield {"ok": 1.0}[c]

    good = FunctionRewards([per_completion]).begin()
    good.submit("k0", "p", "ok", "a")
    assert good.results()["k0"].reward == 1.0
    _fails_naming_the_function(per_completion)


def _fails_naming_the_function(fn) -> None:  # noqa: ANN001
    """Scoring completions "ok" and "bad" with `fn` (which raises KeyError on "bad") fails with the RewardError
    naming `fn`, the KeyError chained."""
    batch = FunctionRewards([fn]).begin()
    batch.submit("k0", "p", "ok", "a")
    batch.submit("k1", "p", "bad", "a")
    with pytest.raises(RewardError, match=rf"reward function .*{fn.__name__} raised KeyError: 'bad'") as e:
        batch.results()
    assert isinstance(e.value.__cause__, KeyError)


# ---- checks by hand of the reward sources' contracts ------------------------------------------------------------


class _FakeRewardClient:
    """Stands in for RewardClient: each submit gets a Future the test resolves."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self._future = Future
        self.requests, self.futures = [], []

    def submit(self, req):  # noqa: ANN001
        self.requests.append(req)
        self.futures.append(self._future())
        return self.futures[-1]


def _response(key: str, reward: float = 1.0, ok: bool = True, correct: bool = True, error: str = ""):
    from tlt.v1 import reward_pb2

    return reward_pb2.ScoreResponse(id=key, reward=reward, ok=ok, correct=correct, error=error)


def test_grpc_batch_checks_every_response_and_cancels_the_rest_on_failure():
    from tlt.services.trainer.rewards import _GrpcBatch

    client = _FakeRewardClient()
    batch = _GrpcBatch(client)
    batch.submit("k0", "p", "c", "a", {"level": "hard", "tags": ["x", 1], "n": 3})
    assert dict(client.requests[0].metadata) == {"level": "hard", "tags": '["x", 1]', "n": "3"}  # text as is
    assert sorted(client.requests[0].json_metadata_keys) == ["n", "tags"]  # which values are JSON, not text
    with pytest.raises(ValueError, match="submitted twice"):
        batch.submit("k0", "p", "c", "a")
    batch.submit("k1", "p", "c", "a")
    client.futures[0].set_result(_response("k0", ok=False, error="verifier crashed"))

    def late_answer() -> None:  # so that a batch that waits for k1 fails the test instead of hanging it
        with contextlib.suppress(InvalidStateError):
            client.futures[1].set_result(_response("k1"))

    timer = threading.Timer(1.0, late_answer)
    timer.start()
    try:
        with pytest.raises(RewardError, match="could not score completion k0: verifier crashed"):
            batch.results()
        assert client.futures[1].cancelled()  # the step fails at once: nothing more is waited for
    finally:
        timer.cancel()

    batch = _GrpcBatch(client := _FakeRewardClient())
    batch.submit("k0", "p", "c", "a")
    client.futures[0].set_result(_response("k9"))
    with pytest.raises(RewardError, match="answered id 'k9' for completion k0"):
        batch.results()

    batch = _GrpcBatch(client := _FakeRewardClient())
    batch.submit("k0", "p", "c", "a")
    client.futures[0].set_result(_response("k0", reward=0.0, correct=True))
    assert batch.results()["k0"] == RewardResult(0.0, True)  # the server's verdict, not reward > 0


def test_a_grpc_batch_refuses_text_it_cannot_send_with_reward_error_naming_the_completion():
    # a lone surrogate (half an emoji) in a column's text: the request could not be encoded and protobuf's raw
    # UnicodeEncodeError ended the step after its whole rollout
    from tlt.services.trainer.rewards import _GrpcBatch

    batch = _GrpcBatch(client := _FakeRewardClient())
    with pytest.raises(RewardError, match="completion k0 cannot be sent to the reward server: .*surrogates"):
        batch.submit("k0", "p", "c", "a", {"source": "forum \ud83d"})
    assert client.requests == []


def test_function_rewards_refuse_bools_too_many_values_and_mismatched_weights():
    def flag(prompts, completions, **kw):
        return [True for _ in completions]

    batch = FunctionRewards([flag]).begin()
    batch.submit("k0", "p", "c", "a")
    with pytest.raises(RewardError, match="returned True for completion k0"):
        batch.results()
    batch = FunctionRewards([lambda prompts, completions, **kw: [1.0, 2.0, 3.0]]).begin()
    batch.submit("k0", "p", "c", "a")
    batch.submit("k1", "p", "c", "a")
    with pytest.raises(RewardError, match="returned 3 values for 2 completions"):
        batch.results()
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        FunctionRewards([length_reward, exact], weights=[1.0])
    with pytest.raises(ValueError, match="1 reward functions but 2 weights"):
        FunctionRewards([length_reward], weights=[1.0, 2.0])


def test_functions_taking_kwargs_get_answers_prompts_and_columns():
    from tlt.services.trainer.rewards import TrainerState

    seen = {}

    def anything(completions, **kw):
        seen.update(kw)
        return [0.0 for _ in completions]

    def positional(prompts, completions, **kw):
        seen["positional"] = (prompts, kw)
        return [0.0 for _ in completions]

    batch = FunctionRewards([anything, positional]).begin()
    batch.submit("k0", "p0", "c0", "a0", {"level": 1})
    batch.submit("k1", "p1", "c1", "a1")
    batch.results()
    assert seen["prompts"] == ["p0", "p1"] and seen["answer"] == seen["answers"] == ["a0", "a1"]
    assert seen["level"] == [1, None]
    assert seen["trainer_state"] == TrainerState()  # as TRL passes its state to every function
    assert seen["positional"] == (["p0", "p1"], {"level": [1, None], "answer": ["a0", "a1"], "answers": ["a0", "a1"],
                                                 "trainer_state": TrainerState()})


def test_make_reward_source_passes_the_timeout_and_retries_to_the_client():
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.rewards import make_reward_source

    src = make_reward_source(TrainerConfig(reward="grpc", reward_address="127.0.0.1:9", reward_timeout_s=7.5,
                                           reward_retries=4))
    try:
        assert isinstance(src, GrpcRewards) and src.address == "127.0.0.1:9"
        assert (src._client.timeout_s, src._client.retries) == (7.5, 4)
    finally:
        src.close()


def test_a_reward_function_without_reward_python_is_refused():
    """`reward_function = "rf:boom"` under the default reward = "task" (or "grpc") was ignored: the run scored with
    the task verifier and never called it. The [reward] server refuses the same mix."""
    from pydantic import ValidationError

    from tlt.services.trainer.config import TrainerConfig

    for reward in ("task", "grpc"):
        with pytest.raises(ValidationError, match="reward_function is read only with reward='python'"):
            TrainerConfig(reward=reward, reward_function="rf:boom")
    assert TrainerConfig(reward="python", reward_function="rf:boom").reward_function == "rf:boom"


def test_tlt_train_whose_rollout_serves_other_weights_ends_with_one_line(monkeypatch, tmp_path, capfd):
    """A rollout server restarted mid-run (serving version 0) or pushed to by another trainer ended `tlt train` with a
    StaleWeightsError / WeightPushError traceback; now one train_failed line saying what happened and what to run."""
    from tlt.cli import main
    from tlt.services.rollout.client import WeightPushError
    from tlt.services.trainer import loop
    from tlt.services.trainer.weight_sync import StaleWeightsError

    for error in (StaleWeightsError("completions carry policy version(s) [0] but version 112 was pushed"),
                  WeightPushError("policy version 97 is not newer than the serving 97")):
        def failing(cfg, error=error):  # noqa: ANN001, ANN202
            raise error

        monkeypatch.setattr(loop, "train", failing)
        rc = main(["train", "--config", "cpu-tiny", "--set", f"output_dir={tmp_path / 'run'}"])
        out = capfd.readouterr()
        text = out.out + out.err
        assert rc == 1 and "train_failed" in text and str(error) in text
        # the restart hint only where a restart helps: a refused push (too large, another model) fails again
        assert ("resumes from its checkpoint" in text) == isinstance(error, StaleWeightsError), text
        assert "Traceback" not in text, text[-2000:]


def test_a_column_only_later_rows_have_reaches_the_function_aligned_with_the_completions():
    """A data set whose first rows lack a column (a mixed-task file: `level` only on the math rows): the function
    still gets that column, one value per completion, None for the rows without it, in the completions' order."""
    seen = {}

    def by_level(completions, level, **kw):
        seen["level"] = level
        return [float(x or 0) for x in level]

    batch = FunctionRewards([by_level]).begin()
    batch.submit("k0", "p0", "c0", "a0")
    batch.submit("k1", "p1", "c1", "a1", {"level": 3})
    batch.submit("k2", "p2", "c2", "a2", {})
    batch.submit("k3", "p3", "c3", "a3", {"level": 5})
    got = batch.results()
    assert seen["level"] == [None, 3, None, 5]
    assert [got[k].reward for k in ("k0", "k1", "k2", "k3")] == [0.0, 3.0, 0.0, 5.0]
