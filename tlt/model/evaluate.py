"""`tlt model eval`: accuracy and response-length tail of a model on the synthetic task.

Pipeline: held-out problems -> ChatML prompts -> a generator (greedy for
accuracy, temperature 1.0 sampling for the length distribution) -> verifier
and token counts -> `EvalReport`. Two generators:

- `native` (the default): the rollout's own engine (`LLMEngine`, plain
  decoding, continuous batching), every problem in flight at once. Each
  problem's samples are seeded by problem index, so two checkpoints scored
  with one seed draw the same random numbers per problem whatever the
  batching. On the CI CPU it is ~3.5x faster than `transformers` (session 37:
  200 greedy + 200 sampled answers of the tiny model in 15.6 s against 55.5 s).
- `transformers`: `generate` in left-padded batches of `--batch-size` (one
  sampling seed per batch, so the sampled figures depend on the batch size).
  What `tlt model build` and `tlt model eval` used up to session 36.

Greedy accuracy is the same with either, up to float near-ties between two
tokens; the sampled figures are other draws of the same distribution.

Response length = generated tokens up to and including the first eos
(`<|im_end|>`), or all of them when the model never stops. Held-out problems
are drawn with a seed the build never trains on (`EVAL_SEED_OFFSET`); short
problems have few distinct instances, so some also occur in training, as they
would in any fresh draw from the task.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tlt.task import Problem

EVAL_SEED_OFFSET = 1_000_003  # eval problems use seed + this; training uses other seeds


@dataclass(frozen=True)
class EvalReport:
    n: int
    accuracy: float  # greedy, exact answer
    samples: int  # sampled responses per problem (temperature 1.0) for the length figures
    p50_len: float
    p99_len: float
    tail_ratio: float  # p99 / p50 of sampled response lengths (tokens)
    sampled_accuracy: float
    accuracy_by_steps: dict[str, float]  # "1", "2", "3-4", "5-8", "9-16", "17-32"
    seconds: float
    # per problem, in the order of the problems (for paired comparisons; left out of as_dict)
    greedy_correct: tuple[bool, ...] = field(default=(), repr=False)
    sampled_correct: tuple[int, ...] = field(default=(), repr=False)  # of `samples`
    engine: str = "transformers"  # which generator answered: "native" (the rollout engine) or "transformers"
    # share of the sampled completions by where each first leaves the reference derivation (tlt.task.slips)
    sampled_slips: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["greedy_correct"], d["sampled_correct"]
        return d


@dataclass(frozen=True)
class PairedDifference:
    """mean(a - b) over problems, with the standard error of that mean from the per-problem differences."""

    mean: float
    se: float
    ci95: tuple[float, float]  # normal approximation: mean +- 1.96 se


def paired_difference(a: list[float], b: list[float]) -> PairedDifference:
    """Difference of two models' per-problem scores on the same problems (and the same sampling seeds): the
    problems' difficulty cancels, so this s.e. is far below that of two independent accuracies."""
    import math
    import statistics

    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two equally long score lists of >= 2 problems, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))
    return PairedDifference(mean, se, (mean - 1.96 * se, mean + 1.96 * se))


def paired_counts(a: Sequence[int], a_samples: int, b: Sequence[int], b_samples: int) -> PairedDifference:
    """`paired_difference` of per-problem correct counts, each over its samples per problem (a's minus b's share)."""
    return paired_difference([c / a_samples for c in a], [c / b_samples for c in b])


def compare(report: EvalReport, against: EvalReport) -> dict[str, PairedDifference]:
    """`report` minus `against`, paired by problem: greedy accuracy and sampled accuracy."""
    return {
        "greedy": paired_counts(report.greedy_correct, 1, against.greedy_correct, 1),
        "sampled": paired_counts(report.sampled_correct, report.samples, against.sampled_correct, against.samples),
    }


def percentile(values: list[int], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) as numpy computes it by default."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _bucket(steps: int) -> str:
    if steps <= 2:
        return str(steps)
    hi = 1 << (steps - 1).bit_length()  # the power of two >= steps
    return f"{hi // 2 + 1}-{hi}"


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    max_new_tokens: int,
    do_sample: bool,
    batch_size: int = 64,
    seed: int = 0,
    bar: Any = None,
) -> tuple[list[str], list[int]]:
    """Completions (decoded without special tokens) and their lengths in tokens, in the order of `prompts`.
    `bar` (a tqdm) advances by one per generated batch."""
    import torch

    eos = tokenizer.eos_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    texts: list[str] = [""] * len(prompts)
    lengths: list[int] = [0] * len(prompts)
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, padding_side="left")
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=1.0 if do_sample else None,
                top_k=0 if do_sample else None,
                top_p=1.0 if do_sample else None,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        for row, i in zip(new.tolist(), idx):
            n = row.index(eos) + 1 if eos in row else len(row)
            lengths[i] = n
            texts[i] = tokenizer.decode(row[:n], skip_special_tokens=True)
        if bar is not None:
            bar.update(1)
    return texts, lengths


class NativeGenerator:
    """Completions from the rollout's own engine (`LLMEngine` on the CPU, float32, plain decoding): every prompt in
    flight at once, continuous batching, no padding. Sample `s` of prompt `i` under `seed` is drawn with the
    engine's per-sequence counter RNG keyed by (seed, s, i), so it does not depend on what else runs beside it."""

    def __init__(self, model_dir: str | Path, *, threads: int = 1, max_num_seqs: int = 256) -> None:
        from tlt.services.rollout.engine.config import EngineConfig
        from tlt.services.rollout.engine.engine import LLMEngine

        # the tiny model at 256 sequences x ~300 positions: ~0.7 GB of float32 KV; fewer blocks only queue some
        self.engine = LLMEngine(model_dir, EngineConfig(threads=threads, max_num_seqs=max_num_seqs, kv_cache_mb=768))

    def __call__(self, prompts: list[str], *, max_new_tokens: int, do_sample: bool, samples: int = 1, seed: int = 0,
                 bar: Any = None) -> list[list[tuple[str, int]]]:
        """Per prompt, `samples` (text, length) pairs: greedy (then `samples` must be 1) or sampled at T = 1.0.
        `bar` advances by each answer as it finishes (`LLMEngine.generate` runs the pass)."""
        from tlt.services.rollout.types import GenerationRequest, SamplingParams

        if not do_sample and samples != 1:
            raise ValueError("greedy decoding gives one answer per prompt: samples must be 1")
        tok = self.engine.tokenizer
        encoded = [tuple(tok(prompt)["input_ids"]) for prompt in prompts]
        longest, limit = max(map(len, encoded), default=0), self.engine.max_model_len
        if longest + max_new_tokens > limit:  # the engine's ValueError, a traceback, for each request
            from tlt.model.folder import CheckpointError

            raise CheckpointError(f"the model's context is {limit} tokens, under an eval prompt ({longest} tokens) "
                                  f"and its {max_new_tokens} new tokens: this eval needs a longer context")
        requests = [
            GenerationRequest(f"eval-{i}", encoded[i],
                              SamplingParams(temperature=1.0 if do_sample else 0.0, max_tokens=max_new_tokens,
                                             seed=(seed * 2**31 + i) % 2**62 if do_sample else None,
                                             reproducible=do_sample), n=samples)
            for i in range(len(prompts))
        ]
        done = self.engine.generate(requests, progress=bar.update if bar is not None else None)  # request, sample order
        return [[(c.text, len(c.token_ids)) for c in done[i * samples : (i + 1) * samples]] for i in range(len(prompts))]


def evaluate(
    model: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase | None,
    problems: list[Problem],
    *,
    samples: int = 1,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = False,
    native: NativeGenerator | None = None,
) -> EvalReport:
    """Greedy accuracy and sampled (T=1.0) response-length percentiles on `problems`, generated by `native` when
    given, else by `transformers` `generate` on `model` / `tokenizer` in batches of `batch_size`; `progress`: a bar
    on stderr (answers for `native`, generate batches otherwise)."""
    import time

    from tqdm import tqdm

    from tlt.task import MAX_STEPS, format_prompt, verify
    from tlt.task.slips import slip_shares

    if native is None and (model is None or tokenizer is None):
        raise ValueError("evaluate needs a NativeGenerator or a transformers model and tokenizer")
    t0 = time.monotonic()
    prompts = [format_prompt(p) for p in problems]
    max_new = 7 * max(MAX_STEPS, max(p.steps for p in problems)) + 16  # a reference solution is 6 per step + 5
    lengths: list[int] = []
    per_problem = [0] * len(problems)
    sampled_texts: list[list[str]] = [[] for _ in problems]
    if native is not None:
        bar = tqdm(total=len(prompts) * (1 + samples), desc="eval", unit="answer", dynamic_ncols=True,
                   disable=not progress)
        greedy = [answers[0][0] for answers in native(prompts, max_new_tokens=max_new, do_sample=False, bar=bar)]
        sampled = native(prompts, max_new_tokens=max_new, do_sample=True, samples=samples, seed=seed, bar=bar)
        for i, (answers, p) in enumerate(zip(sampled, problems)):
            lengths += [n for _, n in answers]
            per_problem[i] = sum(verify(text, p.answer) for text, _ in answers)
            sampled_texts[i] = [text for text, _ in answers]
    else:
        batches = -(-len(prompts) // batch_size)
        bar = tqdm(total=batches * (1 + samples), desc="eval", unit="batch", dynamic_ncols=True, disable=not progress)
        greedy, _ = generate(model, tokenizer, prompts, max_new_tokens=max_new, do_sample=False,
                             batch_size=batch_size, bar=bar)
        for s in range(samples):
            texts, lens = generate(
                model, tokenizer, prompts, max_new_tokens=max_new, do_sample=True, batch_size=batch_size,
                seed=seed + s, bar=bar,
            )
            lengths += lens
            for i, (c, p) in enumerate(zip(texts, problems)):
                per_problem[i] += verify(c, p.answer)
                sampled_texts[i].append(c)
    bar.close()
    correct = [verify(c, p.answer) for c, p in zip(greedy, problems)]
    buckets: dict[str, list[bool]] = {}
    for ok, p in zip(correct, problems):
        buckets.setdefault(_bucket(p.steps), []).append(ok)
    p50, p99 = percentile(lengths, 50), percentile(lengths, 99)
    return EvalReport(
        n=len(problems),
        accuracy=sum(correct) / len(problems),
        samples=samples,
        p50_len=p50,
        p99_len=p99,
        tail_ratio=p99 / p50,
        sampled_accuracy=sum(per_problem) / (len(problems) * samples),
        accuracy_by_steps={k: sum(v) / len(v) for k, v in sorted(buckets.items(), key=lambda kv: int(kv[0].split("-")[0]))},
        seconds=time.monotonic() - t0,
        engine="native" if native is not None else "transformers",
        greedy_correct=tuple(correct),
        sampled_correct=tuple(per_problem),
        sampled_slips=slip_shares(problems, sampled_texts),
    )


def eval_problems(n: int, seed: int = 0) -> list[Problem]:
    from tlt.task import generate_problems

    return generate_problems(n, seed + EVAL_SEED_OFFSET)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least

    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder (e.g. artifacts/tiny)")
    parser.add_argument("--n", type=at_least(1), default=200, help="held-out problems")
    parser.add_argument("--samples", type=at_least(1), default=1,
                        help="sampled responses per problem for the length tail")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out draw and of sampling")
    parser.add_argument("--engine", choices=("native", "transformers"), default="native",
                        help="native: the rollout's own engine, all problems in flight, seeded per problem (~3.5x "
                        "faster on a CPU); transformers: `generate` in padded batches (the figures of sessions <= 36)")
    parser.add_argument("--batch-size", type=at_least(1), default=64,
                        help="--engine transformers: generate batch size; the sampled figures depend on it (one "
                        "sampling seed per batch), greedy accuracy does not")
    parser.add_argument("--threads", type=at_least(1), default=2, help="torch CPU threads")
    parser.add_argument("--against", default=None,
                        help="a second checkpoint (e.g. the policy before RL) scored on the same problems with the "
                        "same sampling seeds; prints both and the paired difference --model minus --against with its "
                        "standard error")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _score(path: str, args: argparse.Namespace) -> EvalReport:
    import torch
    from transformers import AutoModelForCausalLM

    from tlt.model.tokenizer import load_tokenizer

    if args.engine == "native":
        return evaluate(None, None, eval_problems(args.n, args.seed), samples=args.samples, seed=args.seed,
                        progress=True, native=NativeGenerator(path, threads=args.threads))
    tokenizer = load_tokenizer(path)
    if tokenizer.pad_token_id is None:  # Llama 3's: batched generate pads (left) with something; eos, as HF suggests
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return evaluate(model, tokenizer, eval_problems(args.n, args.seed), samples=args.samples,
                    batch_size=args.batch_size, seed=args.seed, progress=True)


def _print(report: EvalReport, title: str | None = None) -> None:
    if title:
        print(title)
    print(f"problems            {report.n}")
    print(f"greedy accuracy     {report.accuracy:.1%}")
    print(f"sampled accuracy    {report.sampled_accuracy:.1%}  (T=1.0, {report.samples} per problem)")
    print(f"response length     p50 {report.p50_len:.0f}  p99 {report.p99_len:.0f}  p99/p50 {report.tail_ratio:.2f}")
    print("accuracy by steps   " + "  ".join(f"{k}: {v:.0%}" for k, v in report.accuracy_by_steps.items()))
    if report.sampled_slips:  # what the sampled completions get wrong first (tlt.task.slips)
        print("sampled first slip  " + "  ".join(f"{k}: {v:.1%}" for k, v in report.sampled_slips.items() if v))
    print(f"time                {report.seconds:.1f} s  ({report.engine} engine)")


def run(args: argparse.Namespace) -> int:
    import json

    from tlt.model.folder import check_checkpoint

    # CheckpointError naming what is missing (tlt: one line, exit 2), not a transformers trace; before torch loads
    check_checkpoint(args.model)
    if args.against is not None:
        check_checkpoint(args.against)
    if args.against is not None and args.n < 2:
        import sys

        print("tlt model eval: --against needs --n >= 2 (a standard error over problems)", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    report = _score(args.model, args)
    if args.against is None:
        if args.json:
            print(json.dumps(report.as_dict()))
        else:
            _print(report)
        return 0
    against = _score(args.against, args)
    diff = compare(report, against)
    if args.json:
        print(json.dumps({"model": report.as_dict(), "against": against.as_dict(),
                          "difference": {k: asdict(v) for k, v in diff.items()}}))
        return 0
    _print(report, f"--model {args.model}")
    print()
    _print(against, f"--against {args.against}")
    print()
    print(f"paired difference, --model minus --against, over the same {report.n} problems and sampling seeds:")
    for name, d in diff.items():
        print(f"  {name:8s} {d.mean:+.3f}  (s.e. {d.se:.3f}; 95% {d.ci95[0]:+.3f} .. {d.ci95[1]:+.3f})")
    return 0
