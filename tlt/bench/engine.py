"""`tlt bench engine`: native engine vs `transformers` generate on the same model, greedy.

For each batch size B: B prompts of `--prompt-len` random task-vocabulary
tokens (same length, so `generate` needs no padding), `--max-tokens` new
tokens each, eos ignored on both sides (transformers: no eos id; native:
ignore_eos) so both produce exactly B x max_tokens tokens. Asserts the
tokens are identical, then reports tokens/s of both and the ratio, per CPU-second
of the process (contention-robust at one thread) and per wall-clock second. Each
side runs once untimed first (warm-up), then the two sides alternate for
`--repeats` timed runs each (best kept), so machine load hits both alike. Every native
run starts with an empty prefix cache (the runs repeat the same prompts: a cache hit would skip
prefill work that `generate` does every time). The model is `--model DIR`, else `artifacts/tiny` when it exists,
else a random checkpoint with the tiny preset's shape.
"""

from __future__ import annotations

import argparse
import json
import sys

from tlt.cli_args import at_least, positive_ints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: artifacts/tiny, else a random tiny-shaped one)")
    parser.add_argument("--batch-sizes", type=positive_ints, default="1,8,64", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=at_least(1), default=64, help="new tokens per sequence")
    parser.add_argument("--prompt-len", type=at_least(1), default=32, help="prompt length in tokens")
    parser.add_argument("--threads", type=at_least(1), default=1, help="torch threads for both sides")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="timed runs per side and batch size (best is kept)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from tlt.bench import resolve_model

    model_dir, source = resolve_model(args.model)  # an explicit --model is checked (exit 2), before torch loads
    import torch
    import transformers

    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.model.folder import read_model_config
    from tlt.services.common.config import ConfigError
    from tlt.services.rollout.engine.config import context_limit
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    torch.set_num_threads(args.threads)
    sizes = args.batch_sizes
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ctx = args.prompt_len + args.max_tokens
    limit = context_limit(0, read_model_config(model_dir))
    if ctx > limit:
        raise ConfigError(f"--prompt-len + --max-tokens = {ctx} is past the model's context {limit}")
    engine = LLMEngine(
        model_dir,
        EngineConfig(dtype=args.dtype, max_num_seqs=max(sizes), threads=args.threads,
                     max_num_batched_tokens=max(2048, max(sizes) * args.prompt_len),
                     max_model_len=min(max(ctx + 1, 256), limit)),
    )
    vocab = engine.model_config.vocab_size
    rows = []
    for b in sizes:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(3, vocab, (b, args.prompt_len), generator=g)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

        def native() -> list[list[int]]:
            # every run prefills its prompts, as `generate` does: the warm-up (and each earlier run) left
            # their KV blocks in the prefix cache, and a hit would skip a part of the prefill
            engine.block_manager.reset_prefix_cache()
            reqs = [GenerationRequest(f"b{b}-{i}", tuple(prompts[i].tolist()), params) for i in range(b)]
            return [c.token_ids for c in engine.generate(reqs)]

        def reference() -> list[list[int]]:
            with torch.inference_mode():
                out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.max_tokens,
                                  do_sample=False)
            return out[:, args.prompt_len :].tolist()

        (w_nat, c_nat, got), (w_ref, c_ref, ref) = _interleaved(native, reference, args.repeats)
        same = got == ref
        n = b * args.max_tokens
        rows.append({"batch": b, "native_tok_s": n / c_nat, "transformers_tok_s": n / c_ref, "speedup": c_ref / c_nat,
                     "native_wall_tok_s": n / w_nat, "transformers_wall_tok_s": n / w_ref,
                     "wall_speedup": w_ref / w_nat, "identical": same})
        if not same:
            bad = next(i for i in range(b) if got[i] != ref[i])
            print(f"error: batch {b}: sequence {bad} differs from transformers", file=sys.stderr)
    result = {"model": source, "threads": args.threads, "dtype": args.dtype, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "results": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"model: {source}  dtype {args.dtype}  threads {args.threads}  prompt {args.prompt_len}  new tokens {args.max_tokens}")
        print("tokens/s per CPU-second of this process (one thread: the idle-machine figure); wall-clock beside it")
        print(f"{'batch':>6} {'native tok/s':>13} {'transformers tok/s':>19} {'speedup':>8} {'wall speedup':>13} {'identical':>10}")
        for r in rows:
            print(f"{r['batch']:>6} {r['native_tok_s']:>13.1f} {r['transformers_tok_s']:>19.1f} {r['speedup']:>7.2f}x"
                  f" {r['wall_speedup']:>12.2f}x {str(r['identical']):>10}")
    return 0 if all(r["identical"] for r in rows) else 1


def _interleaved(a, b, repeats: int):
    """Warm both up, then alternate timed runs (a, b, a, b, ...) so load changes hit both alike.

    Returns per side (best wall seconds, best CPU seconds of this process, output). With one thread the
    CPU time is what the run would take on an otherwise idle core, so it is the figure that stays
    comparable on a shared machine; wall time is reported beside it.
    """
    import time

    outs = [a(), b()]
    wall = [float("inf"), float("inf")]
    cpu = [float("inf"), float("inf")]
    for _ in range(max(1, repeats)):
        for k, fn in enumerate((a, b)):
            t0, c0 = time.perf_counter(), time.process_time()
            outs[k] = fn()
            wall[k] = min(wall[k], time.perf_counter() - t0)
            cpu[k] = min(cpu[k], time.process_time() - c0)
    return (wall[0], cpu[0], outs[0]), (wall[1], cpu[1], outs[1])
