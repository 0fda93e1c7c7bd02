"""The suite's own hygiene: a test that changes os.environ without monkeypatch (as `tlt.cli.main` run in-process
does: `rollout serve` exports TLT_PRESET) must not leave the change to later tests. Left in place, it made every
later server's replicas differ from the forkserver's environment, so they were spawned (torch imported again) and
the default suite ran ~40% longer on a Zen 3 CI machine (BENCHMARKS.md, "Session 36"). tests/conftest.py puts the
environment back; these two tests, in this order, fail without it."""

from __future__ import annotations

import os

PROBE = "SUITE_ENVIRONMENT_PROBE"


def test_a_test_sets_a_variable_without_monkeypatch() -> None:
    assert PROBE not in os.environ
    os.environ[PROBE] = "left behind"


def test_the_next_test_finds_it_gone() -> None:
    assert PROBE not in os.environ
