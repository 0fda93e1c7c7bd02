"""`tlt bench rollout`'s figures by hand: what each published number is computed from.

tests/test_spec_bench.py runs the bench end to end, where step times are milliseconds and most checks hold within
a millisecond's tolerance (a step counted in the wrong place is lost in it) or hold whichever way a figure is
taken. Here the timed run (`_run_mode`) is driven by a clock that advances exactly one second per step, on a real
engine, and the report's arithmetic (`mode_result`, `add_speedups`, `median_result`, `print_table`) is fed
hand-made measurements, so each figure is pinned to the one value it must have.
"""

from __future__ import annotations

import argparse
import itertools

from tlt.bench import rollout_engine
from tlt.bench.rollout_report import MEDIAN_FIELDS, add_speedups, median_result, mode_result, print_table


def _one_second_per_step():  # noqa: ANN202
    """A clock for `_run_mode`: each call one second later, so every step's dt is exactly 1 (it reads the clock
    once before and once after a step)."""
    ticks = itertools.count()
    return lambda: float(next(ticks))


def _engine(model_dir, spec: bool = False):  # noqa: ANN001, ANN202
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig

    engine = LLMEngine(str(model_dir), EngineConfig(max_num_seqs=8, max_model_len=128, num_kv_blocks=64))
    if spec:
        engine.enable_spec(SpecConfig(mode="adaptive", threshold=4, drafter="ngram"))
    return engine


def _staircase(count: int = 6, tokens: int | None = None):  # noqa: ANN202
    """`count` greedy requests of 1..count tokens (eos ignored; all `tokens` long if given): after the prefill the
    running batch shrinks by one each step, so the batch equal to the threshold occurs."""
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    return [GenerationRequest(f"r{k}", (5, 6, 7, 8 + k),
                              SamplingParams(temperature=0.0, max_tokens=tokens or k, ignore_eos=True))
            for k in range(1, count + 1)]


def _recorded(engine) -> list:  # noqa: ANN001
    """Record (batch size, decode-only) of every step the engine schedules (`_run_mode` wraps this in turn)."""
    seen: list = []
    schedule = engine.scheduler.schedule

    def recording():  # noqa: ANN202
        batch = schedule()
        seen.append((len(batch.seqs), batch.is_decode_only) if batch is not None else (0, False))
        return batch

    engine.scheduler.schedule = recording
    return seen


def test_the_tail_is_every_step_at_or_below_the_threshold_and_only_those(random_model_dir):
    """Tail time: the steps whose batch is 1..threshold, the threshold itself included, each step's own time."""
    engine = _engine(random_model_dir)
    seen = _recorded(engine)
    outs, m = rollout_engine._run_mode(engine, _staircase(), 4, _one_second_per_step())
    assert sorted(len(v) for v in outs.values()) == [1, 2, 3, 4, 5, 6]
    assert len(seen) == m["steps"] and (4, True) in seen  # a step at exactly the threshold
    b = m["buckets"]
    assert all(seconds == steps for _, seconds, steps in b.values())  # every step lasted one second
    assert m["tail_time"] == sum(1 for size, _ in seen if 0 < size <= 4) == b["1"][1] + b["2-4"][1]
    assert m["tail_tokens"] == b["1"][0] + b["2-4"][0]
    assert b["2-4"][2] == sum(1 for size, _ in seen if 2 <= size <= 4)
    assert m["wall"] == 2 * m["steps"] + 1  # t0, then two readings per step, then the end


def test_decode_steps_leave_the_prefill_out(random_model_dir):
    """decode_steps (the denominator of sd_step_share) counts the decode-only steps: not the prefill."""
    engine = _engine(random_model_dir)
    seen = _recorded(engine)
    _, m = rollout_engine._run_mode(engine, _staircase(), 4, _one_second_per_step())
    assert m["steps"] == sum(n for _, _, n in m["buckets"].values()) == len(seen)
    assert m["decode_steps"] == sum(1 for _, decode in seen if decode) < m["steps"]


def _measured(wall: float = 12.5) -> dict:
    # a 12.5 s run of ten steps (the steps' 10 s and the rest: scheduling, bookkeeping): 5 s at batch 6 (60 tokens),
    # 3 s at batch 2-4 (15 tokens), 2 s at batch 1 (4 tokens); threshold 4
    return {"wall": wall, "buckets": {"5-16": (60, 5.0, 5), "2-4": (15, 3.0, 3), "1": (4, 2.0, 2)},
            "tail_tokens": 19, "tail_time": 5.0, "steps": 10, "decode_steps": 9, "verify_steps": 3,
            "verified_seq_steps": 6}


def test_mode_result_figures_by_hand():
    outs = {("r", 0): list(range(79))}
    r = mode_result("ngram", outs, _measured(), {"verify_steps": 3, "mean_accept_len": 2.5, "arms": {}})
    assert r["tokens"] == 79 and r["tok_per_s"] == 6.3
    assert r["tail_s"] == 5.0 and r["tail_share"] == 0.4  # of the wall time
    assert r["tail_tok_per_s"] == 3.8  # tail tokens over tail seconds: 19 / 5
    assert r["tail4_tok_per_s"] == 3.8  # buckets 1 and 2-4: (15 + 4) / (3 + 2)
    assert list(r["buckets"]) == ["1", "2-4", "5-16"]  # in bucket order
    assert r["buckets"]["2-4"]["tok_per_s"] == 5.0 and r["sd_step_share"] == round(3 / 9, 3)


def _result(mode: str, wall: float) -> dict:
    return mode_result(mode, {("r", 0): list(range(79))}, _measured(wall), {"verify_steps": 0, "arms": {}})


def test_speedups_are_over_off_wherever_off_runs_in_the_order():
    """`--modes ngram,off`: the speed-ups are still over off, not over the first mode run."""
    row = [_result("ngram", 5.0), _result("off", 10.0)]
    add_speedups(row)
    assert [r["speedup_vs_off"] for r in row] == [2.0, 1.0]
    assert [r["tok_speedup_vs_off"] for r in row] == [2.0, 1.0]
    no_off = [_result("ngram", 5.0)]
    add_speedups(no_off)
    assert "speedup_vs_off" not in no_off[0]


def _run(i: int, wall: float, speedup: float, tok: float, tail4: float) -> dict:
    return {"mode": "ngram", **{k: 1.0 + i for k in MEDIAN_FIELDS}, "wall_s": wall, "buckets": {},
            "mean_accept_len": 2.0, "identical_to_first_mode": None, "arms": {},
            "speedup_vs_off": speedup, "tok_speedup_vs_off": tok, "tail4_speedup": tail4}


def test_median_over_an_even_number_of_rounds_is_the_mean_of_the_middle_two():
    """`--repeats 2` (or any even R): the median is the mean of the two middle runs, not the lower one; and
    every speed-up, the tokens/s one included, is summarised over the rounds."""
    res = median_result([_run(0, 3.0, 1.2, 1.3, 1.4), _run(1, 5.0, 1.6, 1.7, 1.8)], sampled=True)
    assert res["wall_s"] == 4.0 and res["steps"] == 1.5
    assert res["speedup_vs_off"] == 1.4 and res["speedup_vs_off_range"] == [1.2, 1.6]
    assert res["tok_speedup_vs_off"] == 1.5 and res["tok_speedup_vs_off_range"] == [1.3, 1.7]
    assert res["tail4_speedup"] == 1.6 and res["tail4_speedup_range"] == [1.4, 1.8]


def test_the_table_puts_each_figure_in_its_column(capsys):
    """The table BENCHMARKS.md quotes: each column its own figure (the `b<=4 x` column the tail's speed-up, not the
    whole run's; tail% the tail's share of the wall time, not the verify steps'; no accept length for a mode that
    never verified), each bucket cell its own speed-up over off's bucket, and at T > 0 the tokens/s speed-ups."""
    off, ng = _result("off", 10.0), _result("ngram", 5.0)
    ng["buckets"]["1"]["tok_per_s"] = 6.0  # batch 1 three times off's 2.0: the tail's tokens/s 7.6 over 3.8
    ng["tail4_tok_per_s"] = 7.6
    ng["verify_steps"], ng["mean_accept_len"] = 3, 2.5
    row = [off, ng]
    for r in row:
        r["identical_to_first_mode"] = True
    add_speedups(row)
    assert ng["speedup_vs_off"] == 2.0 and ng["tail4_speedup"] == 2.0
    ng["tail4_speedup"] = 3.0  # told apart from the wall-time speed-up
    report = {"model": "m", "sequences": 1, "requests": 1, "lengths_p50": 79, "lengths_max": 79, "results": row}
    print_table(report, argparse.Namespace(temperature=0.0, threshold=4, bandit="fresh"))
    lines = capsys.readouterr().out.splitlines()
    # mode, wall s, tok/s, speedup, tail s, tail%, tail tok/s, b<=4 x, verify, SD%, accept, lossless
    assert next(x for x in lines if x.startswith("ngram ")).split() == [
        "ngram", "5.00", "15.8", "2.00", "5.00", "100%", "3.8", "3.00", "3", "33%", "2.50", "identical"]
    assert next(x for x in lines if x.startswith("off ")).split() == [
        "off", "10.00", "7.9", "1.00", "5.00", "50%", "3.8", "1.00", "0", "33%", "-", "identical"]
    header = next(i for i, x in enumerate(lines) if x.startswith("tokens/s per batch-size bucket"))
    assert lines[header + 3].split() == ["ngram", "6.0", "(3.00x)", "5.0", "(1.00x)", "12.0", "(1.00x)"]
    ng["tok_speedup_vs_off"] = 1.9  # sampled: other samples, so the tokens/s ratio differs from the wall one
    for r in row:
        r["identical_to_first_mode"] = None
    print_table(report, argparse.Namespace(temperature=1.0, threshold=4, bandit="fresh"))
    sampled = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sampled: "))
    assert sampled.endswith("beside the wall-time one: off 1.00, ngram 1.90"), sampled


def test_hook_cost_divides_each_time_by_its_own_count(random_model_dir, monkeypatch):
    """`--hook-cost`: the hooks' time per call and the forward's per step, each over its own number of calls.
    A CPU clock that advances 1 s per forward and 1 us per hook call makes them exactly 1000 ms and 1 us."""
    import time

    engine = _engine(random_model_dir, spec=True)
    now = [0.0]
    run, wants = engine.runner.run, engine.spec_decoder.wants

    def timed_run(batch):  # noqa: ANN001, ANN202
        now[0] += 1.0
        return run(batch)

    def timed_wants(batch):  # noqa: ANN001, ANN202
        now[0] += 1e-6
        return wants(batch)

    monkeypatch.setattr(engine.runner, "run", timed_run)
    monkeypatch.setattr(engine.spec_decoder, "wants", timed_wants)
    requests = _staircase(6, tokens=8)
    monkeypatch.setattr(time, "process_time", lambda: now[0])
    h = rollout_engine._hook_cost(engine, requests, repeats=10)
    assert h["batch"] == 6 and h["sd_on"] is False  # above the threshold of 4
    assert h["forward_ms"] == 1000.0 and h["hooks_us"] == 1.0 and h["hooks_share"] == 1e-6


def test_reused_engines_start_every_run_clean_and_the_report_gives_the_workloads_lengths(capsys, random_model_dir,
                                                                                         monkeypatch):
    """`--engine reuse`: each timed run prefills every prompt (the prefix cache reset, as a weight update resets
    it: a hit on the last run's prompt blocks would skip prefill work a real step does) and sends new request ids
    (no drafter state keyed by request carries the last run's tokens). The header's response lengths are the
    workload's: the median and the longest of every sequence's."""
    import json
    import statistics

    from tlt.bench import rollout, rollout_workload

    runs: list[tuple[list[str], int]] = []  # (request ids, prefix-cache hits) per timed run
    real = rollout._run_mode

    def recording(engine, requests, threshold, clock=None):  # noqa: ANN001, ANN202
        before = engine.block_manager.shared_hits
        out = real(engine, requests, threshold, clock)
        runs.append(([r.request_id for r in requests], engine.block_manager.shared_hits - before))
        return out

    monkeypatch.setattr(rollout, "_run_mode", recording)
    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    # one sample per prompt of 24 tokens (a full 16-token block each, shared by no other request of a run)
    argv = ["--model", str(random_model_dir), "--prompts", "3", "--n", "1", "--median-tokens", "6", "--max-tokens",
            "16", "--modes", "off,ngram", "--threshold", "4", "--repeats", "2", "--bandit", "keep", "--engine", "reuse",
            "--seed", "4"]
    args = parser.parse_args([*argv, "--json"])
    assert rollout.run(args) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{\n"):])
    assert len(runs) == 4 and all(hits == 0 for _, hits in runs), runs
    assert len({rid for ids, _ in runs for rid in ids}) == 4 * 3  # no id sent twice
    _, lengths = rollout_workload.synthetic_requests(args)
    flat = lengths.flatten().tolist()
    assert flat[0] != max(flat)  # the first sequence is not the longest: the figure is taken over all of them
    assert report["lengths_max"] == max(flat) and report["lengths_p50"] == statistics.median(flat)


def _workload_args(*argv: str) -> argparse.Namespace:
    from tlt.bench import rollout

    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_task_workload_is_prompts_times_n_as_the_report_says(random_model_dir):
    """Greedy: prompts x n distinct problems, one sequence each (n greedy samples of one problem would be
    identical). Sampled: `prompts` problems, each one request of n samples at the temperature, seeded per request."""
    from tlt.bench.rollout_workload import request_seed, task_requests

    greedy, _ = task_requests(random_model_dir, _workload_args("--workload", "task", "--prompts", "2", "--n", "3"))
    assert len(greedy) == 6 and all(r.n == 1 and r.params.temperature == 0.0 for r in greedy)
    assert len({r.prompt_token_ids for r in greedy}) == 6
    sampled, _ = task_requests(random_model_dir, _workload_args("--workload", "task", "--prompts", "2", "--n", "3",
                                                                "--temperature", "0.7"))
    assert len(sampled) == 2 and all(r.n == 3 and r.params.temperature == 0.7 for r in sampled)
    assert [r.params.seed for r in sampled] == [request_seed(0, 0), request_seed(0, 1)]
    assert [r.prompt_token_ids for r in sampled] == [r.prompt_token_ids for r in greedy[:2]]  # the same stream


def test_the_synthetic_workload_forces_each_samples_length_and_seeds_each_apart():
    """One request per sample: its forced length (eos ignored, or the tail vanishes), the prompt of its group, and
    at T > 0 a seed of its own (i * n + j: no two samples of the batch share one)."""
    from tlt.bench.rollout_workload import request_seed, synthetic_requests

    args = _workload_args("--prompts", "3", "--n", "2", "--temperature", "1.0", "--seed", "2")
    requests, lengths = synthetic_requests(args)
    assert len(requests) == 6 and lengths.shape == (3, 2)
    for k, r in enumerate(requests):
        i, j = divmod(k, 2)
        p = r.params
        assert r.request_id == f"p{i}s{j}" and r.prompt_token_ids == requests[2 * i].prompt_token_ids
        assert p.ignore_eos and p.max_tokens == int(lengths[i, j]) and p.temperature == 1.0
        assert p.seed == request_seed(2, k)
    assert len({r.params.seed for r in requests}) == 6
    greedy, _ = synthetic_requests(_workload_args("--prompts", "3", "--n", "2"))
    assert all(r.params.seed is None and r.params.temperature == 0.0 for r in greedy)


def test_min_tokens_keeps_a_solution_of_exactly_that_length(random_model_dir):
    """`--min-tokens K` keeps solutions of at least K tokens: one of exactly K is kept."""
    from tlt.bench.rollout_workload import long_problems
    from tlt.model.tokenizer import load_tokenizer
    from tlt.task import generate_problems

    tok = load_tokenizer(random_model_dir)
    seed = 7_000_003
    first = generate_problems(1, seed)[0]
    exact = len(tok.encode(first.solution, add_special_tokens=False))
    assert long_problems(tok, 1, seed, exact) == [first]


def test_arms_are_listed_most_chosen_first_and_a_run_counts_only_its_own():
    """The arms of a result: most chosen first (the table's order), each with its share and accept length; on a
    reused engine (`spec_delta`: the counters after the run minus before) only the arms this run chose."""
    from tlt.bench.rollout_report import _arm_summary

    arms = _arm_summary({"6_1_7": {"verify_steps": 1, "seq_steps": 2, "emitted": 5},
                         "8_4_16": {"verify_steps": 3, "seq_steps": 4, "emitted": 12}})
    assert list(arms) == ["8_4_16", "6_1_7"]
    assert arms["8_4_16"]["share"] == 0.75 and arms["8_4_16"]["accept_len"] == 3.0
    before = {"verify_steps": 4, "emitted_tokens": 17, "seq_steps": 6,
              "arms": {"6_1_7": {"verify_steps": 1, "seq_steps": 2, "emitted": 5},
                       "8_4_16": {"verify_steps": 3, "seq_steps": 4, "emitted": 12}}}
    after = {"verify_steps": 6, "emitted_tokens": 27, "seq_steps": 10,
             "arms": {"6_1_7": {"verify_steps": 1, "seq_steps": 2, "emitted": 5},
                      "8_4_16": {"verify_steps": 5, "seq_steps": 8, "emitted": 22}}}
    d = rollout_engine.spec_delta(before, after)
    assert d["arms"] == {"8_4_16": {"verify_steps": 2, "seq_steps": 4, "emitted": 10}}  # 6_1_7: not chosen this run
    assert d["verify_steps"] == 2 and d["mean_accept_len"] == 2.5
