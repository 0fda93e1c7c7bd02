"""`tlt bench rollout` runs end to end on a tiny random checkpoint and its lossless check holds."""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch

from tlt.bench import rollout, rollout_workload
from tlt.bench.rollout_report import SAMPLED_NOTE


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


# the JSON fields of a single-round report (before --repeats existed)
R1_REPORT_KEYS = {"model", "device", "dtype", "kernels", "graphs", "workload", "temperature", "requests", "sequences", "lengths_p50", "lengths_max",
                  "threshold", "arms", "buckets", "bucket_arms", "clock", "bandit", "results"}
R1_RESULT_KEYS = {"mode", "wall_s", "tokens", "tok_per_s", "tail_s", "tail_share", "tail_tok_per_s", "tail4_tok_per_s",
                  "buckets", "steps", "decode_steps", "verify_steps", "verified_seq_steps", "sd_step_share",
                  "mean_accept_len", "arms", "identical_to_first_mode", "speedup_vs_off", "tok_speedup_vs_off",
                  "tail4_speedup", "gc_s"}
R1_BUCKET_KEYS = {"tokens", "seconds", "steps", "tok_per_s", "speedup_vs_off"}


def test_bench_rollout_report_buckets_tail_and_arms(capsys, random_model_dir):
    # 6 sequences with threshold 4: the prefill step runs at batch 6 (outside the tail), the rest shrinks
    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--prompts", "3", "--n", "2", "--median-tokens", "8",
                                 "--max-tokens", "40", "--modes", "off,ngram", "--threshold", "4"])
    assert rc == 0 and report["temperature"] == 0.0 and report["arms"] is None
    assert report["requests"] == report["sequences"] == 6
    import gc

    assert gc.get_freeze_count() == 0  # --gc-freeze on froze the heap for the timed runs only, not the caller's
    # --repeats 1 (the default) reports exactly the fields it always did: no rounds, ranges or run order
    assert set(report) == R1_REPORT_KEYS
    for r in report["results"]:
        assert set(r) == R1_RESULT_KEYS and all(set(b) == R1_BUCKET_KEYS for b in r["buckets"].values())
    modes = {r["mode"]: r for r in report["results"]}
    for r in modes.values():
        b = r["buckets"]
        assert "5-16" in b and set(b) <= {"1", "2-4", "5-16", "17-63", ">=64"}
        assert sum(x["tokens"] for x in b.values()) == r["tokens"] > 0  # every emitted token is in one bucket
        assert sum(x["steps"] for x in b.values()) == r["steps"] >= r["decode_steps"]
        assert sum(x["seconds"] for x in b.values()) <= r["wall_s"] + 1e-3
        assert 0 < r["tail_s"] <= r["wall_s"] and 0 < r["tail_share"] <= 1
        assert 0 <= r["gc_s"] < r["wall_s"]  # the collector's seconds inside the run (--gc-freeze on: collected before)
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
    assert ng["tok_speedup_vs_off"] == round(ng["tok_per_s"] / off["tok_per_s"], 2) and off["tok_speedup_vs_off"] == 1.0
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


def test_bench_rollout_takes_bucket_thresholds_and_arms_per_bucket(capsys, random_model_dir):
    """`--buckets` and '/' in `--arms` give the adaptive bandit its buckets and each its own arms (as
    `tlt rollout serve --spec-arms` does): 6 sequences decoding at batch 6 -> 1 meet both buckets' arms."""
    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--prompts", "6", "--n", "1", "--median-tokens",
                                 "12", "--sigma", "0.8", "--max-tokens", "24", "--modes", "off,ngram", "--threshold",
                                 "8", "--buckets", "1,4", "--arms", "3_1_4/6_1_7,plain"])
    assert rc == 0 and report["buckets"] == [1, 4] and report["bucket_arms"] == [["3_1_4"], ["6_1_7", "plain"]]
    assert report["arms"] is None  # no single list shared by every bucket
    used = set(next(r for r in report["results"] if r["mode"] == "ngram")["arms"])
    assert "3_1_4" in used and used & {"6_1_7", "plain"}, used
    for bad in (["--buckets", "1,4", "--arms", "3_1_4/6_1_7/plain"],  # three lists for two buckets
                ["--buckets", "4,1", "--arms", "3_1_4"], ["--buckets", "1,x", "--arms", "3_1_4"],
                ["--buckets", "1,4"]):  # buckets without arms
        parser = argparse.ArgumentParser()
        rollout.add_arguments(parser)
        assert rollout.run(parser.parse_args(["--model", str(random_model_dir), "--modes", "off,ngram", *bad])) == 2, bad


def test_bench_rollout_sampled_table_and_bad_flags(capsys, random_model_dir):
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "1", "--median-tokens", "6", "--max-tokens", "12"]
    assert rollout.run(parser.parse_args([*common, "--temperature", "0.8", "--modes", "off,ngram"])) == 0
    out = capsys.readouterr().out
    assert out.count(SAMPLED_NOTE) == 2 and "identical" not in out and "batch 1" in out
    assert rollout.run(parser.parse_args([*common, "--arms", "6_1_7,bogus"])) == 2
    assert rollout.run(parser.parse_args([*common, "--temperature", "-1"])) == 2
    capsys.readouterr()
    for bad, says in ((["--device", "cuda", "--clock", "cpu"], "--clock wall"),  # CPU time cannot time a GPU
                      (["--graphs", "cuda"], "needs the Triton decode path"),
                      (["--kernels", "triton", "--graphs", "cuda"], "needs a CUDA device"),
                      (["--device", "gpu"], "must be a torch device"),
                      (["--device", "gpu", "--clock", "cpu"], "must be a torch device"),  # the device first
                      (["--device", "cuda", "--hook-cost"], "--hook-cost times this process's CPU")):
        assert rollout.run(parser.parse_args([*common, *bad])) == 2, bad
        assert says in capsys.readouterr().err, bad
    if not torch.cuda.is_available():  # a GPU run asked for on a machine without one: refused before any engine
        assert rollout.run(parser.parse_args([*common, "--device", "cuda", "--kernels", "torch"])) == 2
        assert "sees no CUDA device" in capsys.readouterr().err


def _check_median(ratios_or_values: list, median: float, span: list | None = None) -> None:
    present = [v for v in ratios_or_values if v is not None]
    assert median == statistics.median(present)
    if span is not None:
        assert span == [min(present), max(present)] and span[0] <= median <= span[1]


def test_bench_rollout_repeats_interleaved_medians(capsys, random_model_dir):
    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "2", "--median-tokens", "8",
              "--max-tokens", "24", "--modes", "off,ngram,learned", "--threshold", "4"]
    rc, report = _bench(capsys, [*common, "--repeats", "3"])
    assert rc == 0 and report["repeats"] == 3
    rounds = report["rounds"]
    assert len(rounds) == 3 and all([r["mode"] for r in row] == ["off", "ngram"] for row in rounds)  # learned skipped
    # interleaved: round r runs off then ngram before round r+1 starts
    runs = sorted((r for row in rounds for r in row), key=lambda r: r["run_index"])
    assert [(r["round"], r["mode"]) for r in runs] == [(k, m) for k in range(3) for m in ("off", "ngram")]
    assert [r["run_index"] for r in runs] == list(range(6))
    assert all(r["identical_to_first_mode"] is True for r in runs)
    modes = {r["mode"]: r for r in report["results"]}
    assert modes["learned"] == {"mode": "learned", "skipped": "no --drafter given"}
    for j, mode in enumerate(("off", "ngram")):
        res, raw = modes[mode], [row[j] for row in rounds]
        assert res["identical_to_first_mode"] is True
        for key in ("wall_s", "tok_per_s", "tail_s", "tail_tok_per_s", "tail4_tok_per_s", "tokens"):
            _check_median([r[key] for r in raw], res[key])
        # speed-ups: the median (and range) of the per-round ratios over that round's off run
        per_round = [round(row[0]["wall_s"] / row[j]["wall_s"], 2) for row in rounds]
        assert [r["speedup_vs_off"] for r in raw] == per_round
        _check_median(per_round, res["speedup_vs_off"], res["speedup_vs_off_range"])
        _check_median([r["tail4_speedup"] for r in raw], res["tail4_speedup"], res["tail4_speedup_range"])
        for label, b in res["buckets"].items():
            present = [r["buckets"][label] for r in raw if label in r["buckets"]]
            assert b["runs"] == len(present) >= 1
            _check_median([x["tok_per_s"] for x in present], b["tok_per_s"])
            if b["speedup_vs_off"] is not None:
                _check_median([x["speedup_vs_off"] for x in present], b["speedup_vs_off"], b["speedup_vs_off_range"])
        # arms: counts summed over the rounds, accept length and share from the sums
        for name, a in res["arms"].items():
            for key in ("verify_steps", "seq_steps", "emitted"):
                assert a[key] == sum(r["arms"].get(name, {}).get(key, 0) for r in raw)
            assert a["accept_len"] == round(a["emitted"] / a["seq_steps"], 2)
    assert modes["off"]["speedup_vs_off"] == 1.0 and modes["off"]["speedup_vs_off_range"] == [1.0, 1.0]
    ng = modes["ngram"]
    assert ng["arms"]
    assert sum(a["verify_steps"] for a in ng["arms"].values()) == sum(r[1]["verify_steps"] for r in rounds)
    assert abs(sum(a["share"] for a in ng["arms"].values()) - 1) < 0.01

    # the table: medians, speed-ups with their per-round range
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    assert rollout.run(parser.parse_args([*common, "--repeats", "2"])) == 0
    out = capsys.readouterr().out
    assert "median of 2 interleaved rounds" in out
    assert re.search(r"^ngram .* \d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\) ", out, re.M)
    assert rollout.run(parser.parse_args([*common, "--repeats", "0"])) == 2


def test_bench_rollout_repeats_lossless_check_every_round(capsys, random_model_dir, monkeypatch):
    """A mode that differs in one round only (here: round 1's ngram run, tampered) fails the whole bench."""
    real, calls = rollout._run_mode, []

    def tampered(engine, requests, threshold, clock=None):  # noqa: ANN001, ANN202
        outs, measured = real(engine, requests, threshold, clock)
        calls.append(engine.spec_decoder is not None)
        if len(calls) == 4:  # run_index 3: round 1, ngram
            key = next(iter(outs))
            outs[key] = [*outs[key][:-1], outs[key][-1] + 1]
        return outs, measured

    monkeypatch.setattr(rollout, "_run_mode", tampered)
    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--prompts", "2", "--n", "1", "--median-tokens", "6",
                                 "--max-tokens", "12", "--modes", "off,ngram", "--threshold", "4", "--repeats", "3"])
    assert calls == [False, True] * 3  # interleaved: off, ngram, off, ngram, ...
    assert rc == 1
    assert [[r["identical_to_first_mode"] for r in row] for row in report["rounds"]] == [
        [True, True], [True, False], [True, True]]
    assert {r["mode"]: r["identical_to_first_mode"] for r in report["results"]} == {"off": True, "ngram": False}


def test_bench_rollout_min_tokens(capsys, random_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from tlt.task import format_prompt, generate_problems

    tok = AutoTokenizer.from_pretrained(str(random_model_dir))
    seed = 7_000_003  # the task workload's problem seed at --seed 0
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    args = parser.parse_args(["--model", str(random_model_dir), "--workload", "task", "--prompts", "3", "--n", "1",
                              "--min-tokens", "60"])
    requests, _ = rollout_workload.task_requests(random_model_dir, args)

    def length(p):  # noqa: ANN001, ANN202
        return len(tok.encode(p.solution, add_special_tokens=False))

    stream = generate_problems(3000, seed)
    want = [p for p in stream if length(p) >= 60][:3]
    assert len(want) == 3 and any(length(p) < 60 for p in stream[:3])  # the filter changes the workload
    assert [r.prompt_token_ids for r in requests] == [tuple(tok.encode(format_prompt(p))) for p in want]
    monkeypatch.setattr(rollout_workload, "MIN_TOKENS_SCAN", 4096)  # the impossible cases below give up sooner
    try:
        rollout_workload.long_problems(tok, 1, seed, 10_000)  # no problem is that long (32 steps at most)
    except ValueError as e:
        assert "10000 tokens" in str(e)
    else:
        raise AssertionError("expected ValueError")

    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--workload", "task", "--prompts", "2", "--n", "1",
                                 "--max-tokens", "8", "--min-tokens", "60", "--modes", "off", "--threshold", "4"])
    assert rc == 0 and report["min_tokens"] == 60 and report["sequences"] == 2
    common = ["--model", str(random_model_dir), "--prompts", "1", "--n", "1", "--max-tokens", "8", "--modes", "off"]
    assert rollout.run(parser.parse_args([*common, "--min-tokens", "60"])) == 2  # synthetic workload: refused
    assert rollout.run(parser.parse_args([*common, "--workload", "task", "--min-tokens", "10000"])) == 2


def test_bench_rollout_cpu_clock_and_chain_cut(capsys, random_model_dir):
    """--clock cpu times steps by the process's CPU time (the report says so); --chain-min-prob reaches the
    learned modes' SpecConfig and is range-checked."""
    import time

    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "2", "--median-tokens", "8", "--max-tokens", "16",
              "--modes", "off,ngram", "--threshold", "8"]
    c0 = time.process_time()
    rc, report = _bench(capsys, [*common, "--clock", "cpu"])
    used = time.process_time() - c0
    assert rc == 0 and report["clock"] == "cpu"
    for r in report["results"]:
        assert 0 < r["wall_s"] <= used  # CPU seconds of this process, inside the CPU time the call used
        assert abs(sum(b["seconds"] for b in r["buckets"].values()) - r["wall_s"]) < 0.5 * r["wall_s"]
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    assert rollout.run(parser.parse_args([*common, "--chain-min-prob", "1.0"])) == 2
    assert rollout.run(parser.parse_args([*common, "--chain-min-prob", "-0.1"])) == 2
    ns = parser.parse_args([*common, "--chain-min-prob", "0.25", "--drafter", "some/dir"])
    assert rollout._spec_config("learned", ns, None).chain_min_prob == 0.25


def test_bench_rollout_hook_cost(capsys, random_model_dir):
    """--hook-cost times the adaptive decoder's per-step hooks at the full batch against the forward."""
    rc, report = _bench(capsys, ["--model", str(random_model_dir), "--prompts", "4", "--n", "2", "--median-tokens", "8",
                                 "--sigma", "0", "--max-tokens", "12", "--modes", "off,ngram", "--threshold", "2",
                                 "--hook-cost"])
    assert rc == 0 and set(report["hook_cost"]) == {"ngram"}  # off has no decoder
    h = report["hook_cost"]["ngram"]
    assert h["batch"] == 8 and h["sd_on"] is False  # every sequence decoding, above the threshold of 2
    assert h["forward_ms"] > 0 and h["hooks_us"] > 0
    assert abs(h["hooks_share"] - h["hooks_us"] / 1e3 / h["forward_ms"]) < 1e-4


def test_bench_rollout_bandit_keep_carries_over_rounds(capsys, random_model_dir):
    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "2", "--median-tokens", "8",
              "--max-tokens", "24", "--modes", "off,ngram,static-ngram", "--threshold", "4", "--repeats", "3"]
    rc, fresh = _bench(capsys, common)
    assert rc == 0 and fresh["bandit"] == "fresh"
    assert all("bandit_start_rewards" not in r for row in fresh["rounds"] for r in row)  # cold every run
    rc, kept = _bench(capsys, [*common, "--bandit", "keep"])
    assert rc == 0 and kept["bandit"] == "keep"
    assert all("bandit_start_rewards" not in row[2] for row in kept["rounds"])  # static: no bandit
    held = [row[1]["bandit_start_rewards"] for row in kept["rounds"]]
    verify = [row[1]["verify_steps"] for row in kept["rounds"]]
    # round r starts with every reward rounds 0..r-1 recorded (the window is far larger than these runs)
    assert held[0] == 0 and held[1] == verify[0] > 0 and held[2] == verify[0] + verify[1]
    assert all(r["identical_to_first_mode"] for row in kept["rounds"] for r in row)  # still lossless


def test_bench_rollout_engine_reuse_keeps_one_engine_per_mode_and_counts_each_run(capsys, random_model_dir,
                                                                                  monkeypatch):
    """`--engine reuse`: one engine per mode for every timed run (built once after the warm-up, run once untimed),
    its prefix cache reset before each run, and each run's speculation counters its own, not the engine's totals."""
    built: list[str] = []
    real_build = rollout.build_engine

    def counting_build(model_dir, args, mode, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        built.append(mode)
        return real_build(model_dir, args, mode, *a, **k)

    monkeypatch.setattr(rollout, "build_engine", counting_build)
    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "2", "--median-tokens", "8",
              "--max-tokens", "24", "--modes", "off,static-ngram,ngram", "--threshold", "4", "--repeats", "3",
              "--bandit", "keep"]
    rc, fresh = _bench(capsys, common)
    assert rc == 0 and "engine" not in fresh and built.count("off") == 1 + 3  # the warm-up's, then one per run
    built.clear()
    rc, reused = _bench(capsys, [*common, "--engine", "reuse"])
    assert rc == 0 and reused["engine"] == "reuse" and built == ["off", "static-ngram", "ngram"] * 2  # warm-up, kept
    # the adaptive bandit: cold in round 0 (the untimed run's rewards dropped), then carried from round to round
    held = [row[2]["bandit_start_rewards"] for row in reused["rounds"]]
    verify = [row[2]["verify_steps"] for row in reused["rounds"]]
    assert held[0] == 0 and held[1] == verify[0] > 0 and held[2] == verify[0] + verify[1]
    assert all(r["identical_to_first_mode"] for row in reused["rounds"] for r in row)  # lossless on reused engines
    # a static arm decodes the same greedy workload the same way every run: each run counts only its own steps
    for runs in ([row[1] for row in fresh["rounds"]], [row[1] for row in reused["rounds"]]):
        assert len({(r["verify_steps"], r["mean_accept_len"], json.dumps(r["arms"])) for r in runs}) == 1
    # not the engine's running totals (a used engine may start a run with its SD switch already on: a step or two)
    assert abs(reused["rounds"][2][1]["verify_steps"] - fresh["rounds"][0][1]["verify_steps"]) <= 2
    assert fresh["rounds"][0][1]["verify_steps"] > 2
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    assert rollout.run(parser.parse_args([*common[:-2], "--engine", "reuse"])) == 2  # needs --bandit keep


def test_bench_rollout_warms_every_mode_up_before_timing(capsys, random_model_dir, monkeypatch):
    """The first timed run must not pay the process's one-time costs (they made round 0's off run 20-30%
    slower and inflated every speed-up over it): by default every mode decodes the workload once, untimed,
    before the first timed run; `--warmup 0` skips that."""
    from tlt.services.rollout.engine.engine import LLMEngine

    log: list[tuple[str, str]] = []
    real_step, real_run = LLMEngine.step, rollout._run_mode

    def step(self):  # noqa: ANN001, ANN202
        log.append(("step", "off" if self.spec_decoder is None else self.spec_decoder.config.drafter))
        return real_step(self)

    def timed(engine, requests, threshold, clock=None):  # noqa: ANN001, ANN202
        log.append(("timed", ""))
        return real_run(engine, requests, threshold, clock)

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(rollout, "_run_mode", timed)
    common = ["--model", str(random_model_dir), "--prompts", "2", "--n", "2", "--median-tokens", "6",
              "--max-tokens", "12", "--modes", "off,ngram", "--threshold", "4"]
    rc, report = _bench(capsys, common)
    assert rc == 0 and all(r["identical_to_first_mode"] for r in report["results"])
    first = log.index(("timed", ""))
    before = [m for kind, m in log[:first] if kind == "step"]
    timed_steps = sum(1 for kind, m in log[first:] if kind == "step" and m == "off")
    assert before.count("off") == timed_steps > 0  # off decoded the whole workload once, untimed
    assert "ngram" in before  # and so did ngram
    assert [k for k, _ in log].count("timed") == 2
    log.clear()
    rc, _ = _bench(capsys, [*common, "--warmup", "0"])
    assert rc == 0 and log[0] == ("timed", "")
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    assert rollout.run(parser.parse_args([*common, "--warmup", "-1"])) == 2


def test_the_plain_arm_is_no_verify_step_in_the_accept_length_over_rounds():
    """With --repeats R > 1 the accept length (tokens per sequence per verify step) was summed over every arm, the
    bandit's "plain" arm (one token per sequence, no verify pass) included: two rounds of 2.21 reported 1.19.
    Each round's own figure (the engine's) counts verify steps only; so does the median result now."""
    from tlt.bench.rollout_report import MEDIAN_FIELDS, median_result

    def run(i: int) -> dict:
        return {"mode": "ngram", **{k: 1.0 + i for k in MEDIAN_FIELDS}, "buckets": {}, "mean_accept_len": 2.21,
                "identical_to_first_mode": True,
                "arms": {"8_4_16": {"verify_steps": 50, "seq_steps": 100, "emitted": 221},
                         "plain": {"verify_steps": 400, "seq_steps": 1600, "emitted": 1600}}}

    res = median_result([run(0), run(1)], sampled=False)
    assert res["mean_accept_len"] == 2.21
    assert res["arms"]["plain"]["verify_steps"] == 800  # the choices are still counted, as choices


def test_a_figure_that_was_not_measured_is_printed_as_a_dash():
    from tlt.bench.rollout_report import _num, _x

    assert _x(None) == "-" and _x(None, [1.0, 2.0]) == "-" and _num(None, 2) == "-"
    assert _x(1.5, [1.2, 1.7]) == "1.50 (1.20-1.70)" and _num(0.0, 2) == "0.00"


def _refused_before_the_model(capsys, monkeypatch, argv: list[str]) -> str:
    """Run the bench on `argv`, which must be refused (exit 2) before any model is resolved; returns its stderr."""
    import tlt.bench

    def no_model(model):  # noqa: ANN001, ANN202
        raise AssertionError(f"{argv}: the model was resolved before the arguments were checked")

    monkeypatch.setattr(tlt.bench, "resolve_model", no_model)
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    assert rollout.run(parser.parse_args(argv)) == 2, argv
    return capsys.readouterr().err


def test_bench_rollout_checks_every_modes_spec_config_before_the_model(capsys, monkeypatch):
    """Only the adaptive config was checked up front: a static arm over the verify budget (at --threshold 256)
    passed, loaded the model, warmed the earlier modes up and ended in pydantic's traceback; and every SpecConfig
    error was blamed on "--buckets None / --arms None", a bad --static-arm included."""
    err = _refused_before_the_model(capsys, monkeypatch, ["--modes", "off,static-ngram", "--threshold", "256"])
    assert err.count("\n") == 1 and err.startswith("error: mode static-ngram:"), err
    assert "verify_token_budget = 2048" in err and "--verify-budget" in err and "validation error" not in err
    err = _refused_before_the_model(capsys, monkeypatch, ["--modes", "off,ngram", "--static-arm", "bogus"])
    assert err.count("\n") == 1 and "--static-arm" in err and "arm 'bogus'" in err, err
    assert "--buckets None" not in err
    err = _refused_before_the_model(capsys, monkeypatch, ["--modes", "off", "--static-arm", "bogus"])
    assert "arm 'bogus'" in err, err  # checked even when no SD mode runs: refused, not silently ignored


def test_bench_rollout_refuses_non_finite_temperature_and_sigma(capsys, monkeypatch):
    """`--temperature inf` passed the `>= 0` check and `--sigma` was not checked at all: both ended in a
    traceback after the model had loaded."""
    for flag, value in (("--temperature", "inf"), ("--temperature", "nan"), ("--temperature", "-1"),
                        ("--sigma", "nan"), ("--sigma", "inf"), ("--sigma", "-0.5")):
        err = _refused_before_the_model(capsys, monkeypatch, [flag, value, "--modes", "off"])
        assert err.count("\n") == 1 and err.startswith(f"error: {flag} must be a finite number >= 0"), err


def test_a_timed_run_leaves_no_cycle_that_keeps_the_engine(random_model_dir):
    """`_run_mode` wraps the scheduler's `schedule` for the run. Putting the bound method back on the instance
    made a reference cycle through the scheduler that kept the KV cache (the decoder's release hook reaches the
    runner) until a full collection: every mode's engine lived on into later runs, and freeing it there cost up
    to 0.8 s of system time in whichever run the collection fell (BENCHMARKS.md, Session 29). With the cycle
    collector off, dropping the engine must free its KV cache at once."""
    import gc
    import weakref

    import torch

    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    engine = LLMEngine(str(random_model_dir), EngineConfig(max_num_seqs=8, max_model_len=128, num_kv_blocks=64))
    engine.enable_spec(SpecConfig(mode="adaptive", threshold=8, drafter="ngram"))
    requests = [GenerationRequest(f"r{i}", (5, 6, 7, 5, 6, 7, 8 + i), SamplingParams(temperature=0.0, max_tokens=12),
                                  n=2) for i in range(3)]
    outs, measured = rollout._run_mode(engine, requests, 8)
    assert len(outs) == 6 and measured["steps"] > 0
    assert "schedule" not in vars(engine.scheduler)  # the class's method again
    kv = weakref.ref(engine.model.k_caches[0])
    assert isinstance(kv(), torch.Tensor)
    gc.collect()
    gc.disable()
    try:
        del engine
        assert kv() is None, "the engine's KV cache outlived the engine: a reference cycle holds it"
    finally:
        gc.enable()


def test_bench_rollout_after_big_batch_makes_the_hysteresis_apply(capsys, random_model_dir):
    """`--after-big-batch`: each speculative run starts as an RL rollout's tail does, after a step above the
    threshold, so its first `hysteresis` decode steps run plainly; without it a fresh engine speculates at once.
    Outputs stay identical (greedy) either way."""
    def ngram_run(*extra):
        parser = argparse.ArgumentParser()
        rollout.add_arguments(parser)
        args = parser.parse_args(["--model", str(random_model_dir), "--prompts", "2", "--n", "1", "--median-tokens",
                                  "24", "--max-tokens", "48", "--modes", "off,ngram", "--threshold", "4",
                                  "--hysteresis", "6", "--json", *extra])
        assert rollout.run(args) == 0
        out = capsys.readouterr().out
        modes = {r["mode"]: r for r in json.loads(out[out.index("{\n"):])["results"]}
        assert modes["ngram"]["identical_to_first_mode"]
        return modes["ngram"]

    fresh, after = ngram_run(), ngram_run("--after-big-batch")
    plain_steps = lambda r: r["decode_steps"] - r["verify_steps"]  # noqa: E731
    assert plain_steps(after) >= plain_steps(fresh) + 5, (fresh, after)
