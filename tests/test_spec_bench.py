"""`tlt bench rollout` runs end to end on a tiny random checkpoint and its lossless check holds."""

from __future__ import annotations

import argparse
import json

from tlt.bench import rollout


def test_bench_rollout_small(capsys):
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    args = parser.parse_args(["--prompts", "2", "--n", "2", "--median-tokens", "8", "--max-tokens", "48",
                              "--modes", "off,ngram,learned", "--threshold", "4", "--json"])
    assert rollout.run(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n"):])
    modes = {r["mode"]: r for r in report["results"]}
    assert modes["off"]["verify_steps"] == 0
    assert modes["ngram"]["identical_to_first_mode"] and modes["ngram"]["verify_steps"] > 0
    assert modes["learned"]["skipped"] == "no --drafter given"
    assert modes["ngram"]["tokens"] == modes["off"]["tokens"] > 0


def test_bench_rollout_task_workload(capsys, random_model_dir):
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    args = parser.parse_args(["--model", str(random_model_dir), "--workload", "task", "--prompts", "3", "--n", "1",
                              "--max-tokens", "16", "--modes", "off,ngram", "--threshold", "4", "--json"])
    assert rollout.run(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n"):])
    assert report["workload"] == "task" and report["sequences"] == 3 and 1 <= report["lengths_max"] <= 16
    modes = {r["mode"]: r for r in report["results"]}
    assert modes["ngram"]["identical_to_first_mode"] and modes["ngram"]["tokens"] == modes["off"]["tokens"] > 0
