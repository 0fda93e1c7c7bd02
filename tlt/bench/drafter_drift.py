"""`tlt bench drafter-drift`: does online drafter training keep up with a changing policy?

    tlt bench drafter-drift [--model DIR] [--updates 10] [--out BENCH.json]

Simulated RL on a shifted task: the policy (a tiny Qwen2, random unless --model) is fine-tuned a
few steps per update on sequences from a teacher bigram process whose transition table moves a
step further from the start at every update (the task distribution shifts, so the policy's
greedy continuations change). After each update:

    the policy samples its own greedy rollouts --> post-norm last-layer features (transformers)
    online drafter: a few micro-steps on the buffer (newest version first, previous version's long
        sequences as fallback), what the drafter service does in idle windows
    frozen drafter: the warm-up drafter trained on policy version 0 only, never updated
    both: greedy chain acceptance length on held-out rollouts of the CURRENT policy

Both drafters share the policy's live embedding and lm_head (as in the engine), so the frozen one
also sees the new lm_head; only its own layer is stale. The figure of merit is the ratio
online / frozen after the last update (target >= 1.15 at 10 updates).

`--overhead` measures the other half: rollout wall time of long-tail batches on a real rollout
server (2 replicas) with `tlt drafter serve --workers 2` stopped or running, in pairs of adjacent rounds.
"""

from __future__ import annotations

import argparse

from tlt.cli_args import at_least, out_file

PROMPT_SEED_STRIDE = 1_000_003  # prompt generators of different --seed values never meet (tags stay far below it)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="policy checkpoint; default: a random tiny Qwen2 in a temp dir")
    parser.add_argument("--updates", type=at_least(1), default=10, help="K policy updates")
    parser.add_argument("--policy-steps", type=at_least(0), default=8, help="optimizer steps per policy update")
    parser.add_argument("--drafter-steps", type=at_least(0), default=20, help="online drafter micro-steps per update")
    parser.add_argument("--warmup-steps", type=at_least(0), default=60, help="drafter micro-steps on version 0")
    parser.add_argument("--rollouts", type=at_least(1), default=16, help="greedy rollouts per version")
    parser.add_argument("--length", type=at_least(2), default=48, help="tokens per rollout")
    parser.add_argument("--depth", type=at_least(1), default=6, help="chain depth of the acceptance simulation")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the policy and drafter inits, the teacher's samples, the prompts and the buffer's "
                             "sampling (the teacher's two tables, the task, are the same for every seed)")
    parser.add_argument("--overhead", action="store_true", help="measure rollout wall-time overhead instead")
    parser.add_argument("--rounds", type=int, default=10, help="--overhead: pairs of rounds (one without, one with the drafter service)")
    parser.add_argument("--drafter-set", dest="drafter_sets", action="append", default=[], metavar="FIELD=VALUE",
                        help="--overhead: a [drafter] field for `tlt drafter serve` (e.g. train_when=rollout_idle); "
                             "repeatable")
    parser.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                        help="instead of measuring: the overhead over every pair of these --overhead --out files "
                             "together (median and its 95%% interval)")
    parser.add_argument("--out", type=out_file, default=None, help="write the figures as JSON here")


def _teacher(vocab: int, lo: int, hi: int, seed: int):  # noqa: ANN202
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, (vocab,), generator=g)


def run(args: argparse.Namespace) -> int:
    if args.pool:
        from tlt.bench.drafter_overhead import pool_overhead

        return pool_overhead(args.pool)
    if args.drafter_sets and not args.overhead:
        import sys

        print("error: --drafter-set applies to --overhead only (the drift bench trains its drafter in process)",
              file=sys.stderr)
        return 2
    if args.model:
        from tlt.model.folder import check_checkpoint

        check_checkpoint(args.model)  # not a checkpoint: one line, exit 2, before any work
    if args.overhead:
        from tlt.bench.drafter_overhead import measure_overhead

        return measure_overhead(args)
    import json
    import time
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from tlt.bench import scratch_dir
    from tlt.model.drafter import Drafter
    from tlt.services.drafter.acceptance import mean_accept_length
    from tlt.services.drafter.buffer import FeatureBuffer
    from tlt.services.drafter.collect import sample_features
    from tlt.services.drafter.packing import pack
    from tlt.services.drafter.training import make_optimizer, micro_step, target_shared

    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    model_dir = args.model
    if not model_dir:
        from tlt.model.testing import random_checkpoint

        model_dir = str(random_checkpoint(scratch_dir("tlt-drift-") / "m", seed=args.seed))
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg, _, _ = target_shared(model_dir)
    embed = policy.get_input_embeddings().weight
    head = policy.get_output_embeddings().weight
    vocab = cfg.vocab_size
    lo, hi = 5, min(vocab, 250)
    start_table, end_table = _teacher(vocab, lo, hi, 1), _teacher(vocab, lo, hi, 2)
    g = torch.Generator().manual_seed(args.seed)

    def prompts(n: int, tag: int) -> list[list[int]]:
        # per seed and per set (tag k: version k's training set, 10_000 + k: its held-out set, so the two never
        # share a generator); seed 0 keeps the prompts it always had
        gg = torch.Generator().manual_seed(1000 + tag + PROMPT_SEED_STRIDE * args.seed)
        return [[int(x) for x in torch.randint(lo, hi, (4,), generator=gg)] for _ in range(n)]

    def rollouts(version: int, n: int, tag: int) -> list:
        return sample_features(policy, prompts(n, tag), args.length, 0.0, version, window_tokens=256,
                               prefix=f"v{version}-{tag}-")

    def teacher_batch(k: int, n: int = 16, length: int = 48) -> torch.Tensor:
        mix = k / max(1, args.updates)  # fraction of positions that follow the shifted table
        seqs = torch.empty(n, length, dtype=torch.long)
        seqs[:, 0] = torch.randint(lo, hi, (n,), generator=g)
        for t in range(1, length):
            prev = seqs[:, t - 1]
            shifted = torch.rand(n, generator=g) < mix
            seqs[:, t] = torch.where(shifted, end_table[prev], start_table[prev])
        return seqs

    popt = torch.optim.AdamW(policy.parameters(), lr=3e-3)

    def policy_update(k: int) -> None:
        policy.train()
        for _ in range(args.policy_steps):
            x = teacher_batch(k)
            loss = policy(input_ids=x, labels=x).loss
            popt.zero_grad()
            loss.backward()
            popt.step()
        policy.eval()

    # version 0: the policy first learns the start task a little, then both drafters warm up on it
    for _ in range(3):
        policy_update(0)
    t0 = time.time()
    v0 = rollouts(0, args.rollouts, 0)
    frozen = Drafter(cfg, embed, head)
    fopt = make_optimizer(frozen, 1e-3)
    for i in range(args.warmup_steps):
        batch, _ = pack(v0[i % len(v0):] + v0[: i % len(v0)], 4, 256)
        micro_step(frozen, fopt, batch, noise=0.05, generator=g)
    online = Drafter(cfg, embed, head)
    online.load_tensors({k: v.detach().clone() for k, v in frozen.state_dict().items()})
    oopt = make_optimizer(online, 1e-3)
    oopt.load_state_dict(fopt.state_dict())
    buf = FeatureBuffer(4096, 1, 256, long_tokens=16, holdout_every=10**9, seed=args.seed)
    buf.add_samples(v0)
    history = []
    for k in range(1, args.updates + 1):
        policy_update(k)
        buf.add_samples(rollouts(k, args.rollouts, k))  # what the rollout streams to the drafter
        for _ in range(args.drafter_steps):
            micro_step(online, oopt, buf.batch(4, 256))
        held = rollouts(k, max(4, args.rollouts // 4), 10_000 + k)
        online.eval()
        frozen.eval()
        a_on, n = mean_accept_length(online, held, args.depth)
        a_fr, _ = mean_accept_length(frozen, held, args.depth)
        history.append({"update": k, "online": round(a_on, 4), "frozen": round(a_fr, 4), "steps": n})
        print(f"update {k:2d}: accept length online {a_on:.3f}  frozen {a_fr:.3f}  ratio {a_on / a_fr:.3f}")
    last = history[-1]
    res = {"updates": args.updates, "ratio_online_over_frozen": round(last["online"] / last["frozen"], 4),
           "online": last["online"], "frozen": last["frozen"], "history": history, "depth": args.depth,
           "drafter_steps_per_update": args.drafter_steps, "policy_steps_per_update": args.policy_steps,
           "seconds": round(time.time() - t0, 1), "model": model_dir}
    print(json.dumps({k: v for k, v in res.items() if k != "history"}, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
