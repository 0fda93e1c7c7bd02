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


def test_bench_engine_rejects_missing_model(tmp_path, capsys):
    from tlt.cli import main

    assert main(["bench", "engine", "--model", str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert "does not exist" in captured.out + captured.err


def test_bench_engine_native_runs_prefill_every_time(tmp_path, capsys, monkeypatch):
    """The warm-up and timed runs decode the same prompts on one engine: no run may reuse an earlier run's
    prompt KV blocks from the prefix cache (transformers prefills every prompt in every run)."""
    from tlt.services.rollout.engine.engine import LLMEngine

    torch.set_num_threads(1)
    configure_logging(json=False, level="warning")
    ckpt = random_checkpoint(tmp_path / "m", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                             num_kv_heads=1, max_position_embeddings=128, weight_scale=0.05)
    hits: list[int] = []
    real = LLMEngine.generate

    def counted(self, requests):  # noqa: ANN001, ANN202
        before = self.block_manager.shared_hits
        out = real(self, requests)
        hits.append(self.block_manager.shared_hits - before)
        return out

    monkeypatch.setattr(LLMEngine, "generate", counted)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    # 20-token prompts: one full 16-token block per prompt that a later run could share
    args = parser.parse_args(["--model", str(ckpt), "--batch-sizes", "2", "--max-tokens", "4", "--prompt-len", "20",
                              "--repeats", "2", "--json"])
    assert bench.run(args) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["identical"]
    assert hits == [0, 0, 0]  # warm-up + 2 timed runs, each prefilling its prompts in full
