"""`tlt bench drafter-preemption` for real: its own coordinator and capacity publisher, a real `tlt drafter worker`
process training on replica 0, one measured BUSY event, on 127.0.0.1.

tests/test_bench_args.py drives the bench's loop with a fake worker (Popen replaced), and so passed while the real
worker exited at once with a usage error (the bench still passed it --config-json, gone since 9388d6b) and the bench
waited for it forever. This runs the whole bench at its smallest; a hang fails on the timeout.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(120)
def test_drafter_preemption_measures_a_real_worker(random_model_dir, capfd):
    from tlt.cli import main

    rc = main(["bench", "drafter-preemption", "--model", str(random_model_dir), "--preemptions", "1",
               "--batch-rows", "1", "--batch-tokens", "8"])
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    res = json.loads(out[out.index("{"):])
    assert res["preemptions"] == 1 and res["batch"] == "1x8"
    assert 0 < res["p50_ms"] == res["p99_ms"] == res["max_ms"] < 30_000  # BUSY -> released, measured once
    assert "worker_joined" in err and "training_window" in err, err[-3000:]
