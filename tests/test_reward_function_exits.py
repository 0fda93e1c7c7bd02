"""A reward function (or its module) that raises a BaseException: SystemExit, KeyboardInterrupt, or a timeout
library's exception (func_timeout's FunctionTimedOut subclasses BaseException).

Such a raise hung the served call until its deadline (the worker pool's future held it, the handler never
answered) and escaped the trainer's in-process boundary; at import `tlt reward serve` exited with the module's
own code and nothing said. Each is now the item's ok=false naming the function, the step's RewardFunctionFailed,
or one line and exit 2. Real `RewardServer` on 127.0.0.1 with real gRPC; the CLI cases start `tlt reward serve`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from tlt.services.common.ports import free_port
from tlt.services.reward.client import RewardClient
from tlt.services.reward.config import RewardConfig
from tlt.services.reward.server import RewardServer
from tlt.services.trainer.rewards import FunctionRewards, RewardFunctionFailed
from tlt.v1 import reward_pb2

Req = reward_pb2.ScoreRequest

EXITING = textwrap.dedent("""
    import sys


    class FunctionTimedOut(BaseException):  # as func_timeout defines it
        pass


    def score(completions, **kw):
        what = completions[0]
        if what == "exit":
            sys.exit(3)
        if what == "interrupt":
            raise KeyboardInterrupt
        if what == "timeout":
            raise FunctionTimedOut("func_timeout gave up")
        return [1.0]
""")


class FunctionTimedOut(BaseException):
    """func_timeout's: a BaseException."""


@pytest.mark.parametrize("kind", [SystemExit, FunctionTimedOut, GeneratorExit])
def test_in_process_a_base_exception_fails_the_step_naming_the_function(kind) -> None:
    def score(prompts, completions, **kw):  # noqa: ANN001, ANN003
        raise kind(7)

    batch = FunctionRewards([score]).begin()
    batch.submit("k0", "p", "c", "1")
    with pytest.raises(RewardFunctionFailed, match=rf"reward function .*score raised {kind.__name__}"):
        batch.results()


def test_served_a_base_exception_answers_that_item_ok_false_at_once(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "exiting_reward.py").write_text(EXITING)
    config = RewardConfig(kind="python", function="exiting_reward:score", port=0, workers=2)
    with RewardServer(config) as server, RewardClient(server.address, timeout_s=10, retries=0) as client:
        start = time.monotonic()
        results = client.score([Req(id=k, completion=k, reference="1") for k in ("exit", "interrupt", "timeout", "ok")])
        streamed = list(client.score_stream([Req(id="s", completion="exit", reference="1")]))
        took = time.monotonic() - start
    assert [r.ok for r in results] == [False, False, False, True], results
    for r, kind in zip(results, ("SystemExit", "KeyboardInterrupt", "FunctionTimedOut")):
        assert "exiting_reward:score" in r.error and kind in r.error, r.error
    assert len(streamed) == 1 and not streamed[0].ok and "SystemExit" in streamed[0].error, streamed
    assert took < 5, took  # answered, not held until the 10 s deadline


def test_in_process_ctrl_c_still_stops_the_trainer() -> None:
    # in the main thread a KeyboardInterrupt is Ctrl-C (and the trainer's Terminated is SIGTERM): not the function's
    def score(prompts, completions, **kw):  # noqa: ANN001, ANN003
        raise KeyboardInterrupt

    batch = FunctionRewards([score]).begin()
    batch.submit("k0", "p", "c", "1")
    with pytest.raises(KeyboardInterrupt):
        batch.results()


MODULES = {
    "exits_at_import": "import sys\nsys.exit(4)\ndef f(prompts, completions, **kw): return [1.0]\n",
    "argparse_required": "import argparse\np = argparse.ArgumentParser()\np.add_argument('--data', required=True)\n"
                         "args = p.parse_args()\ndef f(prompts, completions, **kw): return [1.0]\n",
}


@pytest.mark.parametrize("module, says", [("exits_at_import", "exited while being imported (SystemExit: 4)"),
                                          ("argparse_required", "exited while being imported (SystemExit: 2)")])
def test_a_module_that_exits_at_import_is_one_line_and_exit_2(tmp_path, module, says) -> None:
    (tmp_path / f"{module}.py").write_text(MODULES[module])
    proc = subprocess.run([sys.executable, "-m", "tlt.cli", "reward", "serve", "--function", f"{module}:f",
                           "--port", str(free_port())], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    # one line of ours; argparse's own usage lines may come before it, naming the module, not tlt
    assert proc.returncode == 2 and len(lines) == (1 if module == "exits_at_import" else 3), proc.stdout + proc.stderr
    assert says in lines[-1] and f"{module}.py:" in lines[-1] and "__main__" in lines[-1], lines[-1]
    assert not any(line.startswith(("usage: tlt", "tlt: error")) for line in lines), lines


def test_a_module_that_parses_optional_arguments_at_import_sees_none_of_tlts(tmp_path) -> None:
    # argparse at module level read `tlt reward serve`'s own flags and printed "usage: tlt ... tlt: error"
    (tmp_path / "argparse_optional.py").write_text(
        "import argparse, sys\np = argparse.ArgumentParser()\np.add_argument('--data')\nargs = p.parse_args()\n"
        "def f(prompts, completions, **kw): return [1.0]\n")
    from tlt.services.trainer.rewards import load_function

    sys.path.insert(0, str(tmp_path))
    try:
        assert load_function("argparse_optional:f")(["p"], ["c"]) == [1.0]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("argparse_optional", None)
