"""The rollout bench's workloads (`tlt bench rollout --workload task | synthetic`): the requests each mode decodes.

`task_requests`: the synthetic task's problems at their natural lengths (stop at eos), optionally only those whose
reference solution is long (`--min-tokens`, what the tail commands use). `synthetic_requests`: random-token
prompts with forced log-normal lengths. Both seed each sampled request from `--seed` (`request_seed`), so every
mode and round decodes the same requests.
"""

from __future__ import annotations

import argparse


def request_seed(base: int, k: int) -> int:
    return base * 1_000_003 + k


def task_requests(model_dir, args: argparse.Namespace):  # noqa: ANN001, ANN202
    """Task problems that stop at eos; returns (requests, longest prompt).

    Greedy: prompts x n distinct problems, one sample each. Sampled: `prompts` problems, each one
    seeded request of n samples (a GRPO group)."""
    from tlt.model.tokenizer import load_tokenizer

    from tlt.services.rollout.types import GenerationRequest, SamplingParams
    from tlt.task import format_prompt

    sampled = args.temperature > 0
    count = args.prompts if sampled else args.prompts * args.n
    tok = load_tokenizer(model_dir)
    problems = long_problems(tok, count, args.seed + 7_000_003, args.min_tokens)
    ids = [tuple(tok.encode(format_prompt(p))) for p in problems]
    if sampled:
        requests = [GenerationRequest(f"t{i}", p, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                                                 seed=request_seed(args.seed, i)), n=args.n)
                    for i, p in enumerate(ids)]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        requests = [GenerationRequest(f"t{i}", p, params) for i, p in enumerate(ids)]
    return requests, max(len(p) for p in ids)


MIN_TOKENS_SCAN = 1 << 17  # problems scanned at most for --min-tokens (about 2 s)


def long_problems(tok, count: int, seed: int, min_tokens: int) -> list:  # noqa: ANN001
    """The first `count` problems of the seeded stream whose reference solution has >= `min_tokens` tokens.

    `generate_problems(n, seed)` is a prefix of `generate_problems(m, seed)` for n < m, so the selection
    does not depend on how far the scan went. Raises ValueError if the first MIN_TOKENS_SCAN problems
    do not hold `count` such problems."""
    from tlt.task import generate_problems

    if min_tokens <= 0:
        return generate_problems(count, seed)
    scan, longest = max(64, 16 * count), 0
    while True:
        kept = []
        for p in generate_problems(scan, seed):
            # A token covers at least one character of this ASCII text: a solution shorter than
            # min_tokens characters cannot qualify, so only the long ones get tokenized.
            if len(p.solution) < min_tokens:
                continue
            n = len(tok.encode(p.solution, add_special_tokens=False))
            longest = max(longest, n)
            if n >= min_tokens:
                kept.append(p)
                if len(kept) == count:
                    return kept
        if scan >= MIN_TOKENS_SCAN:
            raise ValueError(f"only {len(kept)} of the first {scan} problems have a reference solution of >= "
                             f"{min_tokens} tokens (need {count}; the longest seen has {longest})")
        scan = min(2 * scan, MIN_TOKENS_SCAN)


def synthetic_requests(args: argparse.Namespace):  # noqa: ANN202
    """Random-token prompts with forced log-normal lengths (eos ignored); returns (requests, lengths [P, n])."""
    import torch

    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    g = torch.Generator().manual_seed(args.seed)
    lengths = (torch.randn(args.prompts, args.n, generator=g) * args.sigma).exp() * args.median_tokens
    lengths = lengths.round().clamp(1, args.max_tokens).long()
    prompts = [tuple(torch.randint(3, 200, (args.prompt_len,), generator=g).tolist()) for _ in range(args.prompts)]
    # One request per sample so that each has its own length (the n samples of one request share
    # max_tokens, and with eos ignored the tail would vanish). The n-gram drafter indexes siblings per
    # request, so here it matches each sample against its own context only: no sibling help.
    seeded = args.temperature > 0
    requests = [
        GenerationRequest(f"p{i}s{j}", prompts[i], SamplingParams(
            temperature=args.temperature, max_tokens=int(lengths[i, j]), ignore_eos=True,
            seed=request_seed(args.seed, i * args.n + j) if seeded else None))
        for i in range(args.prompts) for j in range(args.n)
    ]
    return requests, lengths
