"""`tlt bench ngram`: host time of the model-free drafter per speculative step, by GRPO group size.

    tlt bench ngram [--groups 8,32,64] [--vocab 64,151936] [--arms 8_1_9,5_4_16] [--steps 300] [--json]

The n-gram drafter runs on the host between two verify passes, for every sequence of the step: index the
tokens the step emitted, match the suffix against the sequence's own text and its siblings', build the trie
and batch the tries into tensors (`NgramSource.draft`, the engine's call). On a GPU that time is added to a
verify pass of ~10-30 ms, so it matters at the batch sizes where SD runs. Times are the process's CPU time. Here one GRPO group of G samples
decodes together, each appending one token per step: with probability --copy the next token of a shared text
(siblings restate the same steps), else a random one, after which it skips a token of the shared text or not
(so siblings drift apart, and one's text runs ahead of another's); a 100-token prompt first. Reported: milliseconds of the
drafting call per step (median of --repeats runs) and microseconds per sequence. No model, no torch forward.
"""

from __future__ import annotations

import argparse

from tlt.cli_args import at_least, non_negative_float, positive_ints


def _share(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _arms(text: str) -> list[str]:
    from tlt.services.rollout.spec.arm import Arm

    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must name at least one arm, got {text!r}")
    for name in names:
        try:
            arm = Arm.parse(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if arm.is_plain:
            raise argparse.ArgumentTypeError("the plain arm drafts nothing; name arms like 8_1_9")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=positive_ints, default=[8, 32, 64], help="GRPO group sizes (sequences per step)")
    parser.add_argument("--vocab", type=positive_ints, default=[64, 151936], help="vocabulary sizes of the random tokens")
    parser.add_argument("--arms", type=_arms, default="8_1_9,5_4_16", help="comma-separated arms (steps_topk_drafttokens)")
    parser.add_argument("--steps", type=at_least(1), default=300, help="decode steps per run")
    parser.add_argument("--copy", type=_share, default=0.7, help="share of tokens copied from the shared text")
    parser.add_argument("--repeats", type=at_least(1), default=3, help="runs per case (the median is reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random texts (run r uses seed + r)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def measure(group: int, vocab: int, arm_name: str, steps: int, copy: float, seed: int) -> float:
    """CPU seconds of `NgramSource.draft` over `steps` decode steps of one group of `group` sequences."""
    import random
    import time

    from tlt.services.rollout.engine.sequence import Sequence
    from tlt.services.rollout.spec.arm import Arm
    from tlt.services.rollout.spec.drafting import NgramSource
    from tlt.services.rollout.types import SamplingParams

    rng = random.Random(seed)
    arm = Arm.parse(arm_name)
    shared = [rng.randrange(vocab) for _ in range(100 + steps)]
    prompt = tuple(shared[:100])
    seqs = [Sequence("g", k, prompt, SamplingParams(temperature=0.0), steps + 1, 0, frozenset()) for k in range(group)]
    at = [100] * group  # where each sample is in the shared text: a token of its own moves it on or not (a
    src = NgramSource(1, 4)  # substitution or an insertion), so the siblings drift apart as real samples do
    spent = 0.0
    for _ in range(steps):
        for k, s in enumerate(seqs):
            if rng.random() < copy:
                s.token_ids.append(shared[at[k]])
                at[k] += 1
            else:
                s.token_ids.append(rng.randrange(vocab))
                at[k] += rng.random() < 0.5
        t0 = time.process_time()  # CPU time: a VM's stolen time would swamp sub-millisecond calls
        src.draft(seqs, arm)
        spent += time.process_time() - t0
    return spent


def run(args: argparse.Namespace) -> int:
    import json
    import statistics

    arms = args.arms
    rows = []
    for vocab in args.vocab:
        for group in args.groups:
            for arm in arms:
                runs = [measure(group, vocab, arm, args.steps, args.copy, args.seed + r) for r in range(args.repeats)]
                per_step = statistics.median(runs) / args.steps
                rows.append({"vocab": vocab, "group": group, "arm": arm, "ms_per_step": per_step * 1e3,
                             "us_per_sequence": per_step / group * 1e6})
    if args.json:
        print(json.dumps({"steps": args.steps, "copy": args.copy, "repeats": args.repeats, "rows": rows}))
        return 0
    print(f"n-gram drafting host time per decode step (median of {args.repeats}; {args.steps} steps, copy {args.copy})")
    print(f"{'vocab':>8} {'group':>6} {'arm':>8} {'ms/step':>9} {'us/seq':>8}")
    for r in rows:
        print(f"{r['vocab']:>8} {r['group']:>6} {r['arm']:>8} {r['ms_per_step']:>9.2f} {r['us_per_sequence']:>8.1f}")
    return 0
