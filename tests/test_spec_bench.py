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


def _bench(capsys, argv: list[str]) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    rc = rollout.run(parser.parse_args([*argv, "--json"]))
    out = capsys.readouterr().out
    return rc, json.loads(out[out.index("{\n"):])


def test_bench_rollout_report_buckets_tail_and_arms(capsys, random_model_dir):
    # 6 sequences with threshold 4: the prefill step runs at batch 6 (outside the tail), the rest shrinks
    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--prompts", "3", "--n", "2", "--median-tokens", "8",
                                 "--max-tokens", "40", "--modes", "off,ngram", "--threshold", "4"])
    assert rc == 0 and report["temperature"] == 0.0 and report["arms"] is None
    assert report["requests"] == report["sequences"] == 6
    modes = {r["mode"]: r for r in report["results"]}
    for r in modes.values():
        b = r["buckets"]
        assert "5-16" in b and set(b) <= {"1", "2-4", "5-16", "17-63", ">=64"}
        assert sum(x["tokens"] for x in b.values()) == r["tokens"] > 0  # every emitted token is in one bucket
        assert sum(x["steps"] for x in b.values()) == r["steps"] >= r["decode_steps"]
        assert sum(x["seconds"] for x in b.values()) <= r["wall_s"] + 1e-3
        assert 0 < r["tail_s"] <= r["wall_s"] and 0 < r["tail_share"] <= 1
        tail = [b[k] for k in ("1", "2-4") if k in b]  # threshold 4: the tail is exactly buckets 1 and 2-4
        assert abs(r["tail_s"] - sum(x["seconds"] for x in tail)) <= 1e-3
        rate = sum(x["tokens"] for x in tail) / sum(x["seconds"] for x in tail)
        assert abs(r["tail4_tok_per_s"] - rate) <= 0.01 * rate  # bucket seconds are rounded in the JSON
        assert r["identical_to_first_mode"] is True
    off, ng = modes["off"], modes["ngram"]
    assert off["arms"] == {} and off["verify_steps"] == 0 and off["sd_step_share"] == 0.0
    assert off["tail4_speedup"] == 1.0 and all(x["speedup_vs_off"] == 1.0 for x in off["buckets"].values())
    for label, x in ng["buckets"].items():
        want = round(x["tok_per_s"] / off["buckets"][label]["tok_per_s"], 2) if label in off["buckets"] else None
        assert x["speedup_vs_off"] == want
    assert ng["tail4_speedup"] == round(ng["tail4_tok_per_s"] / off["tail4_tok_per_s"], 2)
    arms = ng["arms"]
    assert arms and ng["verify_steps"] > 0
    assert sum(a["verify_steps"] for a in arms.values()) == ng["verify_steps"]
    assert sum(a["seq_steps"] for a in arms.values()) == ng["verified_seq_steps"] > 0  # counted by the bench per step
    assert abs(sum(a["share"] for a in arms.values()) - 1) < 0.01
    for a in arms.values():
        assert a["accept_len"] == round(a["emitted"] / a["seq_steps"], 2) >= 1
    mean = sum(a["emitted"] for a in arms.values()) / sum(a["seq_steps"] for a in arms.values())
    assert abs(ng["mean_accept_len"] - mean) < 0.01
    assert ng["sd_step_share"] == round(ng["verify_steps"] / ng["decode_steps"], 3) > 0


def test_bench_rollout_sampled_task_groups(capsys, random_model_dir):
    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--workload", "task", "--prompts", "2", "--n", "3",
                                 "--max-tokens", "16", "--temperature", "1.0", "--modes", "off,ngram",
                                 "--threshold", "8", "--arms", "6_1_7,8_4_16"])  # SD on at batch 6
    assert rc == 0 and report["temperature"] == 1.0 and report["arms"] == ["6_1_7", "8_4_16"]
    assert report["requests"] == 2 and report["sequences"] == 6  # one request of n samples per problem
    modes = {r["mode"]: r for r in report["results"]}
    assert all(r["identical_to_first_mode"] is None for r in modes.values())
    assert sum(x["tokens"] for x in modes["ngram"]["buckets"].values()) == modes["ngram"]["tokens"] > 0
    assert set(modes["ngram"]["arms"]) <= {"6_1_7", "8_4_16"} and modes["ngram"]["verify_steps"] > 0


def test_bench_rollout_sampled_table_and_bad_flags(capsys, random_model_dir):
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "1", "--median-tokens", "6", "--max-tokens", "12"]
    assert rollout.run(parser.parse_args([*common, "--temperature", "0.8", "--modes", "off,ngram"])) == 0
    out = capsys.readouterr().out
    assert out.count(rollout.SAMPLED_NOTE) == 2 and "identical" not in out and "batch 1" in out
    assert rollout.run(parser.parse_args([*common, "--arms", "6_1_7,bogus"])) == 2
    assert rollout.run(parser.parse_args([*common, "--temperature", "-1"])) == 2
