"""A native engine that also has the colocation hooks SGLang's backend has (`release()` / `resume()`), for
tests/test_colocated_lend.py. It runs in the replica's process; it appends what happened to the file named by
TLT_TEST_LEND_LOG so the test can read the order back. Like SGLang's, `release()` refuses while sequences run and
`add_request` refuses while released (the real SGLang engine needs a GPU; this keeps its contract, not its
memory)."""

from __future__ import annotations

import os
import time
from typing import Any

from tlt.services.rollout.engine.engine import LLMEngine


class LendRecordingEngine(LLMEngine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.released = False

    def _log(self, what: str) -> None:
        with open(os.environ["TLT_TEST_LEND_LOG"], "a") as f:
            f.write(f"{what}\n")

    def release(self) -> None:
        if self.has_unfinished():
            raise ValueError("cannot release while sequences run")
        if (delay := float(os.environ.get("TLT_TEST_RELEASE_S", "0"))) > 0:  # SGLang's release is not instant
            self._log("release-start")
            time.sleep(delay)
        self.released = True
        self._log("release")

    def resume(self) -> None:
        if self.released:
            self.released = False
            self._log("resume")

    def add_request(self, req: Any) -> None:
        if self.released:
            raise ValueError("released: resume first")
        self._log("add")
        super().add_request(req)
