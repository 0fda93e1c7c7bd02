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


def test_interleaved_times_warm_runs_only_and_keeps_each_sides_best(monkeypatch):
    """Each side runs once untimed (its first-call costs), then the sides alternate; the best of the timed runs is
    kept per side. A fake clock: side a's runs take 10 (warm-up), 3, 1 s, side b's 20, 5, 6 s."""
    import time

    now = [0.0]
    durations = {"a": [10.0, 3.0, 1.0], "b": [20.0, 5.0, 6.0]}
    calls: list[str] = []

    def side(name: str):  # noqa: ANN202
        def fn() -> str:
            now[0] += durations[name][sum(1 for c in calls if c == name)]
            calls.append(name)
            return f"{name}{len(calls)}"
        return fn

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "process_time", lambda: 2 * now[0])
    (wall_a, cpu_a, out_a), (wall_b, cpu_b, out_b) = bench._interleaved(side("a"), side("b"), 2)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert (wall_a, cpu_a, wall_b, cpu_b) == (1.0, 2.0, 5.0, 10.0)
    assert (out_a, out_b) == ("a5", "b6")  # the last run's output


def test_bench_engine_speedup_is_transformers_time_over_native(tmp_path, capsys, monkeypatch):
    """speedup = transformers' CPU seconds over native's (> 1: native faster); wall_speedup likewise by wall time,
    and tokens/s are B x max_tokens over each side's own seconds."""
    torch.set_num_threads(1)
    configure_logging(json=False, level="warning")
    ckpt = random_checkpoint(tmp_path / "m", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                             num_kv_heads=1, max_position_embeddings=128, weight_scale=0.05)
    # native: 1 s wall, 2 s CPU; transformers: 3 s wall, 8 s CPU (the outputs are the real ones)
    monkeypatch.setattr(bench, "_interleaved", lambda a, b, repeats: ((1.0, 2.0, a()), (3.0, 8.0, b())))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", str(ckpt), "--batch-sizes", "2", "--max-tokens", "4", "--prompt-len", "5",
                              "--json"])
    assert bench.run(args) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["identical"] and row["speedup"] == 4.0 and row["wall_speedup"] == 3.0
    assert row["native_tok_s"] == 2 * 4 / 2.0 and row["transformers_tok_s"] == 2 * 4 / 8.0
    assert row["native_wall_tok_s"] == 8.0 and row["transformers_wall_tok_s"] == 8 / 3.0
