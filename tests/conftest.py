"""Shared pytest fixtures: the tiny task model and random test checkpoints.

- `tiny_model_dir`: the pre-trained tiny model at artifacts/tiny (what `make
  model` builds); built here, once, when its `.complete` marker is missing.
- `random_model_dir`: a seeded random Qwen2 checkpoint with the task tokenizer
  (`tlt.model.testing.random_checkpoint`), fast, for server and engine tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = REPO_ROOT / "artifacts" / "tiny"

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP threads sleep instead of spinning at barriers. On a busy 2-core machine spinning threads starve
# each other: a tiny-model train step measured 5-10x slower. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Control-plane token for every server and client the tests start (services/common/auth.py): like `tlt run`,
# one random token per session in the environment, inherited by child processes.
os.environ.setdefault("TLT_AUTH_TOKEN", "tests-" + os.urandom(8).hex())


@pytest.fixture(autouse=True)
def _process_cpu_settings_restored():
    """A drafter worker built in a test pins the calling thread to its replica's cores and sets torch's thread count,
    as it should in its own process; in the pytest process that left every later test (and every server and replica
    they start, which inherit the affinity) on one core with one torch thread. Put both back after each test.
    Likewise its niceness and scheduling class (`worker_nice`, `worker_sched`): a `tlt drafter worker` run in-process
    (tests/test_signal_stop.py) left the pytest process at nice 19 for the rest of the session, and every server,
    replica and worker started later inherited it (a suite beside any other load slowed to a crawl). Put back where
    the process may; where it may not (raising niceness back needs privilege), the test fails and names it."""
    import sys

    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    priority = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)) if hasattr(os, "sched_getscheduler") \
        else None
    yield
    if priority is not None and (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0)) != priority:
        left = (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
        try:
            os.sched_setscheduler(0, priority[1], os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, 0, priority[0])
        except OSError as e:
            pytest.fail(f"the test left the pytest process at (nice, scheduler) {left}, was {priority}, and it could "
                        f"not be put back ({e}); set worker_nice / coordinator_nice 0 and worker_sched normal in it")
    if affinity is not None and os.sched_getaffinity(0) != affinity:
        os.sched_setaffinity(0, affinity)
    torch = sys.modules.get("torch")
    if threads is not None and torch is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _environment_restored():
    """`tlt.cli.main` run in the pytest process sets what a command's own process should have (`rollout serve`
    exports TLT_PRESET for its replicas). Left in place, it changed the environment every later server's replicas
    start from: the forkserver started with the old one, so each later replica was spawned instead of forked (it
    imports torch again: ~8 s of a core per replica start on a Zen 3 CI machine), and the default suite ran ~40% longer.
    Put the environment back after each test; monkeypatch's own changes are undone before this runs. Kept: what lives
    for the whole session, the same variables the forkserver ignores (pytest's test name, torch's cache folder, the
    process group's rendezvous: the gloo group a trainer test starts outlives it, and DeepSpeed reads LOCAL_RANK at
    every initialize)."""
    from tlt.services.rollout.replica_start import VOLATILE, environ

    before = environ()  # a copy that retries if a server thread sets a variable meanwhile
    yield
    after = environ()
    for key in after.keys() - before.keys() - VOLATILE:
        os.environ.pop(key, None)
    for key, value in before.items():
        if key not in VOLATILE and after.get(key) != value:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _signals_and_log_context_restored():
    """`tlt.cli.main` run in the pytest process installs what a command's own process should have: a server's
    SIGINT / SIGTERM handlers (a `reward serve` that could not bind its port left them, and the rest of the session
    ignored Ctrl-C and a cancelled CI job's SIGTERM), and a drafter worker binds its service name to every later log
    line (structlog's contextvars: {'service': 'drafter-worker-0'} on other tests' lines). The commands put their
    handlers back themselves (tests/test_signal_stop.py); this keeps one that does not from changing later tests.
    Put both back after each test."""
    import signal

    import structlog

    wanted = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = {sig: signal.getsignal(sig) for sig in wanted}
    context = structlog.contextvars.get_contextvars()
    yield
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    if structlog.contextvars.get_contextvars() != context:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**context)


@pytest.fixture()
def no_tlt_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TLT_* variable of the caller's environment: they would change resolved configs and show up as origins.
    A test file that resolves configs uses it for every test (`pytestmark = pytest.mark.usefixtures(...)`)."""
    for key in list(os.environ):
        if key.startswith("TLT_"):
            monkeypatch.delenv(key)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    if not (TINY_MODEL_DIR / ".complete").exists():
        from tlt.model.build import build_model

        build_model("tiny", TINY_MODEL_DIR, seed=0)
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tlt.model.testing import random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("random-qwen2"), family="qwen2")


@pytest.fixture(scope="session")
def hermes_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose chat template renders tools Hermes-style (tests/rollout_helpers.py)."""
    from rollout_helpers import hermes_checkpoint

    return hermes_checkpoint(tmp_path_factory.mktemp("hermes-model"))


@pytest.fixture(scope="session")
def hermes_tok(hermes_model_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    import transformers

    return transformers.AutoTokenizer.from_pretrained(hermes_model_dir)
