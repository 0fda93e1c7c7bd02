"""The engine side of `tlt bench rollout` (tlt/bench/rollout.py says what it measures): the SD config of each mode,
a fresh engine per run, one run decoded to the end with every step timed and its batch bucketed, the speculation
counters of a run on a reused engine, the untimed warm-up, and the decoder's per-step hook cost."""

from __future__ import annotations

import argparse

from tlt.bench.rollout_report import BUCKETS


def _bucket(batch: int) -> str:
    return next(label for lo, hi, label in BUCKETS if batch >= lo and (hi is None or batch <= hi))


def _spec_config(mode: str, args: argparse.Namespace, bucket_arms, buckets=None):  # noqa: ANN001, ANN202
    from tlt.services.rollout.spec.config import SpecConfig

    learned = mode.endswith("learned")
    extra = {} if bucket_arms is None else {"bucket_arms": bucket_arms}
    if buckets is not None and not mode.startswith("static"):
        extra["bucket_thresholds"] = buckets
    if args.verify_budget is not None:
        extra["verify_token_budget"] = args.verify_budget
    if getattr(args, "hysteresis", None) is not None:
        extra["hysteresis_steps"] = args.hysteresis
    return SpecConfig(mode="static" if mode.startswith("static") else "adaptive", threshold=args.threshold,
                      static_arm=args.static_arm, drafter="learned" if learned else "ngram",
                      drafter_path=args.drafter or "", chain_min_prob=args.chain_min_prob,
                      chain_sampling=args.chain_sampling == "on",
                      drafter_graphs=args.drafter_graphs if learned else "off", **extra)


def _bucket_arms(args: argparse.Namespace) -> tuple:
    """(bucket thresholds, arms per bucket or None, the thresholds `--buckets` gave or None) from `--buckets` and
    `--arms`; ValueError for a bad value."""
    from tlt.services.rollout.spec.config import SpecConfig

    bucket_arms, given = None, None
    buckets = SpecConfig().bucket_thresholds
    if args.buckets is not None:
        buckets = given = tuple(int(b) for b in args.buckets.split(","))
    if args.arms is not None:
        lists = [tuple(a.strip() for a in part.split(",") if a.strip()) for part in args.arms.split("/")]
        bucket_arms = tuple(lists[0] for _ in buckets) if len(lists) == 1 else tuple(lists)
    if args.buckets is not None and bucket_arms is None:
        raise ValueError("--buckets needs --arms: one list for every bucket, or one per bucket with '/' between")
    return buckets, bucket_arms, given


def build_engine(model_dir, args: argparse.Namespace, mode: str, num_seqs: int, total_ctx: int,  # noqa: ANN001, ANN201
                 bucket_arms=None, buckets=None):  # noqa: ANN001
    """A fresh engine for one run of `mode`, with room for every sequence at full length (and its SD config)."""
    from tlt.services.rollout.engine.engine import LLMEngine

    engine = LLMEngine(model_dir, _engine_config(args, num_seqs, total_ctx, num_seqs * (total_ctx // 16 + 2) + 64))
    if mode != "off":
        engine.enable_spec(_spec_config(mode, args, None if mode.startswith("static") else bucket_arms, buckets))
    return engine


def _engine_config(args: argparse.Namespace, num_seqs: int, max_model_len: int, num_kv_blocks: int):  # noqa: ANN202
    from tlt.services.rollout.engine.config import EngineConfig

    return EngineConfig(max_num_seqs=num_seqs, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                        device=args.device, dtype=args.dtype, kernels=args.kernels, decode_graphs=args.graphs)


def _first_problem(e: ValueError) -> str:
    """The first problem of a SpecConfig error on one line (pydantic's text is several: a count, the message
    with the whole input echoed, a link)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError) and e.errors():
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        return f"{'.'.join(str(x) for x in err['loc'])}: {msg}" if err["loc"] else msg
    return next(iter(str(e).splitlines()), type(e).__name__)


def _run_mode(engine, requests, threshold: int, clock=None) -> tuple[dict, dict]:  # noqa: ANN001
    """Decode `requests` to the end on `engine`, timing every step with `clock` (default wall time);
    returns (outputs, measurements)."""
    import time

    clock = clock or time.perf_counter

    scheduled: list = [None]  # the batch of the step being run (wraps the engine's scheduler call)
    decode_only = [False]  # whether it was decode-only, read at scheduling time
    schedule = engine.scheduler.schedule

    def probe():  # noqa: ANN202
        scheduled[0] = schedule()
        decode_only[0] = scheduled[0] is not None and scheduled[0].is_decode_only  # before the step changes the seqs
        return scheduled[0]

    engine.scheduler.schedule = probe
    dec = engine.spec_decoder
    try:
        for r in requests:
            engine.add_request(r)
        outs: dict[tuple[str, int], list[int]] = {}
        buckets: dict[str, list] = {}  # label -> [tokens, seconds, steps]
        tail_tokens, tail_time, steps, decode_steps, verify_steps, verified_seq_steps = 0, 0.0, 0, 0, 0, 0
        t0 = clock()
        while engine.has_unfinished():
            scheduled[0] = None
            v0 = dec.verify_steps if dec is not None else 0
            ts = clock()
            emitted, done = engine.step()
            dt = clock() - ts
            steps += 1
            batch = scheduled[0]
            size = len(batch.seqs) if batch is not None else 0
            new = sum(len(s.new_token_ids) for s in emitted)
            if size > 0:
                b = buckets.setdefault(_bucket(size), [0, 0.0, 0])
                b[0] += new
                b[1] += dt
                b[2] += 1
                decode_steps += decode_only[0]
                if size <= threshold:
                    tail_tokens += new
                    tail_time += dt
            if dec is not None and dec.verify_steps > v0:
                verify_steps += 1
                verified_seq_steps += len(emitted)
            for c in done:
                outs[(c.request_id, c.sample_index)] = c.token_ids
        wall = clock() - t0
    finally:
        # the class's method again: assigning the bound method back made a cycle (scheduler -> its __dict__ -> the
        # bound method -> scheduler) that kept the engine's KV cache (through the decoder's release hook) until a full
        # collection, whose munmap of it landed in some later run as up to 0.8 s of system time (BENCHMARKS.md,
        # Session 29)
        del engine.scheduler.schedule
    return outs, {"wall": wall, "buckets": buckets, "tail_tokens": tail_tokens, "tail_time": tail_time,
                  "steps": steps, "decode_steps": decode_steps, "verify_steps": verify_steps,
                  "verified_seq_steps": verified_seq_steps}


def spec_delta(before: dict | None, after: dict | None) -> dict:
    """The speculation counters of one run on an engine (`LLMEngine.stats().spec`, cumulative): after - before.
    A fresh engine's `before` is all zeros, so this is `after` there."""
    if after is None:
        return {}
    if not before:
        return after
    counts = ("verify_steps", "plain_steps", "emitted_tokens", "seq_steps", "drafted_tokens", "no_room",
              "over_budget", "kv_copies", "catch_ups")
    d = dict(after, **{k: after[k] - before.get(k, 0) for k in counts if k in after})
    arms = {}
    for name, a in after.get("arms", {}).items():
        diff = {k: v - before.get("arms", {}).get(name, {}).get(k, 0) for k, v in a.items()}
        if any(diff.values()):
            arms[name] = diff
    d["arms"] = arms
    d["mean_accept_len"] = d["emitted_tokens"] / max(1, d["seq_steps"])
    return d


def _warm_up(engine, requests) -> None:  # noqa: ANN001
    """Decode `requests` to the end on `engine`, untimed (see `--warmup`)."""
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()


def _hook_cost(engine, requests, repeats: int = 20000) -> dict:  # noqa: ANN001
    """What an attached (adaptive) decoder adds to a plain decode step at the full batch: the engine's two
    SD hooks (`wants`, then `observe_plain`), timed `repeats` times by CPU time, against the step's forward
    (runner.run + logits) timed 20 times. Above the threshold these hooks are all SD adds to a step."""
    import copy
    import time

    for r in requests:
        engine.add_request(copy.deepcopy(r))
    sched = engine.scheduler
    while sched.waiting or any(s.num_tokens == s.prompt_len for s in sched.running):
        engine.step()  # prefill until every sequence has its first token
    batch = sched.schedule()  # the next step: every sequence decodes (timed below without advancing)
    dec = engine.spec_decoder
    out = engine.runner.run(batch)
    t0 = time.process_time()
    for _ in range(repeats):
        dec.wants(batch)
        dec.observe_plain(out.emit_seqs, out.hidden)
    hooks = (time.process_time() - t0) / repeats
    t0 = time.process_time()
    for _ in range(20):
        engine.runner.run(batch)
    step = (time.process_time() - t0) / 20
    return {"batch": len(batch.seqs), "sd_on": dec.switch.on, "hooks_us": round(hooks * 1e6, 3),
            "forward_ms": round(step * 1e3, 3), "hooks_share": round(hooks / step, 6)}
