"""`tlt bench engine` runs end to end on a small random checkpoint and reports identical tokens.

Real engine, real transformers; the speed figures are printed, not asserted (speed targets live in
the benchmark, see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json

import torch

from tlt.bench import engine as bench
from tlt.services.common.logging import configure_logging
from tlt.services.rollout.engine.testing import random_checkpoint


def test_bench_engine_json(tmp_path, capsys):
    torch.set_num_threads(1)
    configure_logging(json=False, level="warning")  # as `tlt` does: logs on stderr, stdout is the JSON
    ckpt = random_checkpoint(tmp_path / "m", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                             num_kv_heads=1, max_position_embeddings=128, weight_scale=0.05)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(ckpt), "--batch-sizes", "1,3", "--max-tokens", "6", "--prompt-len", "5",
                              "--repeats", "1", "--json"])
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in out["results"]] == [1, 3]
    assert all(r["identical"] and r["native_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in out["results"])


def test_bench_engine_rejects_missing_model(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--model", str(tmp_path / "nope")])) == 2
