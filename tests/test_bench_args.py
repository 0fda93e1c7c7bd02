"""Every `tlt bench` refuses a count that would crash it later (0, negative, too small) at argument parsing:
an argparse usage error naming the option, exit status 2, before any model is built or server started.

`tlt bench drafter-drift --updates 0` ended in an IndexError after the whole run and `--length 1` in a
ZeroDivisionError; the other benches had the same class of late crash (e.g. `--threads 0`: torch
refuses 0 threads; `--pairs 0`: ValueError; `--preemptions 0`: the max of no latencies). The real
`tlt` parser is used (the one `tlt bench ...` builds), nothing runs past parsing.
"""

from __future__ import annotations

import pytest

from tlt.cli import COMMANDS, build_parser

# (bench, option, refused values, the smallest accepted value)
BAD = [
    ("drafter-drift", "--updates", ["0", "-1"], "1"),
    ("drafter-drift", "--length", ["1", "0", "-5"], "2"),
    ("drafter-drift", "--rollouts", ["0"], "1"),
    ("drafter-drift", "--depth", ["0"], "1"),
    ("drafter-drift", "--policy-steps", ["-1"], "0"),
    ("drafter-drift", "--drafter-steps", ["-1"], "0"),
    ("drafter-drift", "--warmup-steps", ["-1"], "0"),
    ("engine", "--batch-sizes", ["0", "1,0", "4,-2", "", "1,x"], "1"),
    ("engine", "--max-tokens", ["0"], "1"),
    ("engine", "--prompt-len", ["0"], "1"),
    ("engine", "--threads", ["0", "-1"], "1"),
    ("rollout", "--prompts", ["0"], "1"),
    ("rollout", "--n", ["0"], "1"),
    ("rollout", "--prompt-len", ["0"], "1"),
    ("rollout", "--median-tokens", ["0"], "1"),
    ("rollout", "--max-tokens", ["0", "-3"], "1"),
    ("rollout", "--threshold", ["0"], "1"),
    ("rollout", "--threads", ["0"], "1"),
    ("e2e", "--steps", ["0", "-2"], "1"),
    ("e2e", "--pairs", ["0"], "1"),
    ("e2e", "--noise-seed", ["-2", "-100", "x"], "-1"),  # -1 skips the noise run; -2 was taken for -1 too
    ("kernels", "--arch", ["12", "0", "75", "100", "x"], "80"),  # CUDA capabilities the compile check cannot do
    ("drafter-preemption", "--preemptions", ["0"], "1"),
    ("drafter-preemption", "--batch-rows", ["0"], "1"),
    ("drafter-preemption", "--batch-tokens", ["7", "0"], "8"),  # the drafter service's smallest packed row
]


def _parser(bench: str):
    cmd = next(c for c in COMMANDS if c.path == ("bench", bench))
    return build_parser((cmd,))


@pytest.mark.parametrize("bench,option,values,smallest", BAD, ids=[f"{b}{o}" for b, o, _, _ in BAD])
def test_bench_refuses_bad_counts_at_parsing(bench, option, values, smallest, capsys):
    parser = _parser(bench)
    for value in values:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["bench", bench, f"{option}={value}"])
        assert e.value.code == 2, (option, value)
        err = capsys.readouterr().err
        assert f"argument {option}" in err and "must be" in err, err
    ns = parser.parse_args(["bench", bench, f"{option}={smallest}"])  # the limit itself is accepted
    assert getattr(ns, option.lstrip("-").replace("-", "_")) in (int(smallest), [int(smallest)])


def test_batch_sizes_take_spaces_and_a_trailing_comma():
    assert _parser("engine").parse_args(["bench", "engine", "--batch-sizes", "1, 8,64,"]).batch_sizes == [1, 8, 64]


def test_e2e_noise_seed_help_and_error_say_minus_one_skips(capsys):
    """`--noise-seed -1` skips the repeated baseline run; any other negative value did too, silently."""
    parser = _parser("e2e")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "e2e", "--noise-seed=-2"])
    assert "-1 to skip" in capsys.readouterr().err
    assert parser.parse_args(["bench", "e2e", "--noise-seed", "0"]).noise_seed == 0
    assert parser.parse_args(["bench", "e2e"]).noise_seed == 1


def test_kernels_compile_only_arch_is_checked_at_parsing(capsys):
    """`tlt bench kernels --compile-only --arch 12` aborted inside LLVM (and 100 or 120 ended in a ptxas traceback:
    the compile check runs the wheel's pre-Blackwell ptxas): refused at parsing now, naming the supported ones."""
    from tlt.kernels.bench import COMPILE_ARCHS

    parser = _parser("kernels")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "kernels", "--compile-only", "--arch", "12"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --arch" in err and all(str(a) in err for a in COMPILE_ARCHS), err
    assert {80, 90} <= set(COMPILE_ARCHS)
    for arch in COMPILE_ARCHS:
        assert parser.parse_args(["bench", "kernels", "--compile-only", "--arch", str(arch)]).arch == arch
    assert parser.parse_args(["bench", "kernels"]).arch == 90


class _FakeWorkerRun:
    """`tlt bench drafter-preemption`'s loop without a worker: the publisher's BUSY event ends a training window
    of the (fake) coordinator, except for the BUSY events in `missing` (no window within the deadline); a
    fake clock makes the 30 s waits instant. `history` is the coordinator's window limit (it keeps the last N)."""

    def __init__(self, monkeypatch, missing: set[int], preempted: bool = True,  # noqa: ANN001
                 history: int = 200, registers: bool = True, worker_rc: int | None = None,
                 dies_after: int | None = None) -> None:
        import collections
        import subprocess
        import sys
        import time
        import types

        import tlt.model.folder
        import tlt.services.common.events
        from tlt.v1 import common_pb2, drafter_pb2

        self.now, self.idle_events = 1000.0, 0
        self.started: list[tuple[list[str], dict | None]] = []  # (argv, env) of each worker the bench started
        self.configs: list[object] = []  # the config the bench gave its coordinator
        windows: collections.deque = collections.deque(maxlen=history)
        run = self

        class Publisher:
            pub_endpoint, snapshot_endpoint = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"

            def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
                pass

            def publish(self, event):  # noqa: ANN001, ANN202
                if event.state == common_pb2.REPLICA_STATE_IDLE:
                    run.idle_events += 1  # the worker trains: window idle_events - 1
                elif dies_after is not None and run.idle_events > dies_after:
                    pass  # the worker exited (worker_rc): no window comes any more
                elif run.idle_events and run.idle_events - 1 not in missing:  # BUSY ends it (k ms after, k steps)
                    k = run.idle_events - 1
                    windows.append(drafter_pb2.TrainingWindow(preempted=preempted, busy_timestamp=run.now,
                                                              released=run.now + 0.001 * k, micro_steps=k))
                return event

            def close(self) -> None:
                pass

        coordinator = types.SimpleNamespace(workers={"w": 1} if registers else {}, windows=windows,
                                            endpoint="tcp://127.0.0.1:3",
                                            buffer=types.SimpleNamespace(add_samples=lambda s: None),
                                            close=lambda: None)
        coordinator.start = lambda: coordinator

        def sleep(s: float) -> None:
            run.now += s

        monkeypatch.setattr(time, "sleep", sleep)
        monkeypatch.setattr(time, "monotonic", lambda: run.now)
        monkeypatch.setattr(tlt.model.folder, "check_checkpoint", lambda path: None)
        monkeypatch.setattr(tlt.services.common.events, "CapacityPublisher", Publisher)
        # stand-ins for the modules the bench imports only to build a model and a coordinator (importing torch
        # and transformers alone takes seconds)
        generator = types.SimpleNamespace(manual_seed=lambda seed: generator)
        fakes = {"torch": types.SimpleNamespace(set_num_threads=lambda n: None, Generator=lambda: generator,
                                                randint=lambda low, high, size, generator: [low] * size[0]),
                 "transformers": types.SimpleNamespace(AutoModelForCausalLM=types.SimpleNamespace(
                     from_pretrained=lambda path: None)),
                 "tlt.services.drafter.collect": types.SimpleNamespace(sample_features=lambda *a, **k: []),
                 "tlt.services.drafter.coordinator": types.SimpleNamespace(
                     Coordinator=lambda cfg, *a: run.configs.append(cfg) or coordinator)}
        for name, module in fakes.items():
            monkeypatch.setitem(sys.modules, name, module)
        def poll() -> int | None:
            if dies_after is not None and run.idle_events <= dies_after:
                return None
            return worker_rc

        def popen(argv: list[str], env: dict | None = None, **kw) -> object:  # noqa: ANN003
            run.started.append((argv, env))
            return types.SimpleNamespace(terminate=lambda: None, kill=lambda: None, wait=lambda t=None: 0, poll=poll,
                                         returncode=worker_rc)

        monkeypatch.setattr(subprocess, "Popen", popen)

    def run(self, preemptions: int) -> int:
        from tlt.bench import drafter_preemption

        parser = _parser("drafter-preemption")
        return drafter_preemption.run(parser.parse_args(["bench", "drafter-preemption", "--model", "m",
                                                         "--preemptions", str(preemptions)]))


def test_drafter_preemption_counts_each_window_once(monkeypatch, capsys):
    """A BUSY event whose window did not arrive within 30 s measured the previous (already measured) window again;
    and past the coordinator's `history` windows the count of windows stopped growing, so every later BUSY
    waited out the whole 30 s."""
    import json

    fake = _FakeWorkerRun(monkeypatch, missing={2})
    assert fake.run(4) == 0
    res = json.loads(capsys.readouterr().out)
    # four BUSY events, window 2 never came: windows 0, 1 and 3 count, once each
    assert fake.idle_events == 4
    assert res["preemptions"] == 3 and res["mean_steps_per_window"] == (0 + 1 + 3) / 3
    assert res["max_ms"] == pytest.approx(3.0)
    # latencies 0, 1 and 3 ms: the median and numpy's (linear) 99th percentile of those three
    assert res["p50_ms"] == pytest.approx(1.0) and res["p99_ms"] == pytest.approx(1.0 + 0.98 * 2.0)
    fake = _FakeWorkerRun(monkeypatch, missing=set(), history=2)
    assert fake.run(5) == 0 and json.loads(capsys.readouterr().out)["preemptions"] == 5
    assert fake.now - 1000.0 < 5 * 0.7  # no 30 s deadline waited out (idle windows are 0.1-0.6 s)


def test_drafter_preemption_measures_the_workers_first_window(monkeypatch, capsys):
    """The bench left each worker's first window out (it held the first optimizer's import of torch._dynamo, which
    a worker does at its start since): `--preemptions 1` sent two BUSY events and measured only the second. Now
    one BUSY event, one window measured, the first; the output says so."""
    import json

    fake = _FakeWorkerRun(monkeypatch, missing=set())
    assert fake.run(1) == 0
    res = json.loads(capsys.readouterr().out)
    assert fake.idle_events == 1 and res["preemptions"] == 1 and res["mean_steps_per_window"] == 0
    assert "first included" in res["measured"]


def test_drafter_preemption_without_a_preempted_window_is_an_error(monkeypatch, capsys):
    """No window ended by a BUSY event left no latency, and the percentiles of none ended in an IndexError."""
    assert _FakeWorkerRun(monkeypatch, missing=set(), preempted=False).run(3) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "preempted" in err, err


def test_drafter_preemption_starts_its_worker_as_drafter_serve_does(monkeypatch, capsys):
    """The bench started its worker with --config-json, which `tlt drafter worker` no longer takes (9388d6b moved
    the config to the environment): the worker exited with a usage error and the bench waited for it forever.
    The argv it starts now parses with the real `tlt` parser, and the config in its environment loads, as the
    worker loads it, to the config the bench's coordinator runs with."""
    from tlt.cli import build_parser
    from tlt.services.drafter.serve import WORKER_CONFIG_ENV, build_config

    fake = _FakeWorkerRun(monkeypatch, missing=set())
    assert fake.run(1) == 0
    (argv, env), = fake.started
    args = build_parser().parse_args(argv[argv.index("tlt.cli") + 1:])  # a usage error: SystemExit(2)
    assert args._command.path == ("drafter", "worker") and args.replica == 0 and args.coordinator == "tcp://127.0.0.1:3"
    assert env is not None and WORKER_CONFIG_ENV in env, "the worker reads its config from the environment"
    assert build_config(args.preset, args.overrides, env[WORKER_CONFIG_ENV]) == fake.configs[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["exits", "never_registers", "dies_mid_run"])
def test_drafter_preemption_fails_promptly_without_its_worker(monkeypatch, capsys, case):
    """A worker that exited (a usage error, a crash) or never joined the coordinator left the bench waiting
    forever; one that died mid-run cost 30 s per remaining BUSY event. Now: one line naming the worker, exit 1,
    within the bound (a fake clock here)."""
    from tlt.bench import drafter_preemption

    kw = {"exits": dict(registers=False, worker_rc=2), "never_registers": dict(registers=False),
          "dies_mid_run": dict(worker_rc=-9, dies_after=2)}[case]
    fake = _FakeWorkerRun(monkeypatch, missing=set(), **kw)
    assert fake.run(20) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "worker" in err, err
    assert fake.now - 1000.0 <= drafter_preemption.WORKER_JOIN_S + 10, "waited past the bound"
    if case != "never_registers":
        assert str(kw["worker_rc"]) in err, err
