"""`tlt bench kernels`: the Triton kernels against their PyTorch references, on Qwen2.5-7B-like shapes.

With a CUDA GPU: each kernel and its reference are checked to agree, then
timed with `triton.testing.do_bench` (median microseconds), for the decode
batch sizes and context lengths of the rollout tail. Paged decode attention
also reports its effective K/V read bandwidth.

Without a GPU, `--compile-only` compiles the same launches for a CUDA
architecture with the ptxas in the Triton wheel and reports registers and
spills per kernel: a resource check, not a speed measurement.

Shapes (Qwen2.5-7B, bf16): hidden 3584, 28 query heads, 4 KV heads, head dim
128, KV block size 16; tree verify with 48 draft tokens (the 8_4_48 arm).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

HIDDEN, HQ, HKV, HEAD_DIM, BLOCK_SIZE, TREE_TOKENS = 3584, 28, 4, 128, 16, 48
# The compute capabilities `--compile-only` compiles for: the GPUs Triton supports (8.0 and up) below sm_100, which
# the ptxas compile_check runs (the Triton wheel's pre-Blackwell one) cannot assemble. Any other value aborted inside
# LLVM (--arch 12) or ended in a ptxas traceback, after the compiling.
COMPILE_ARCHS = (80, 86, 87, 89, 90)


def compile_arch(text: str) -> int:
    """argparse `type` of `--arch`: one of COMPILE_ARCHS."""
    try:
        value = int(text)
    except ValueError:
        value = 0  # no capability
    if value not in COMPILE_ARCHS:
        raise argparse.ArgumentTypeError(f"must be a CUDA compute capability the compile check supports "
                                         f"({', '.join(map(str, COMPILE_ARCHS))}); got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-only", action="store_true", help="no GPU: compile for --arch and report ptxas usage")
    parser.add_argument("--arch", type=compile_arch, default=90,
                        help=f"CUDA compute capability for --compile-only ({', '.join(map(str, COMPILE_ARCHS))})")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768], help="context lengths (tokens)")
    parser.add_argument("--tree-pages", type=int, nargs="+", default=[1],
                        help="tree-verify variants: cache blocks per kernel loop iteration (1 = the engine's; each "
                             "other value adds a paged_tree_48_p<N> row)")
    parser.add_argument("--tree-warps", type=int, nargs="+", default=[0],
                        help="tree-verify variants: warps per program (0 = the wrapper's choice; each other value "
                             "adds a _w<N> row)")
    parser.add_argument("--tree-block-m", type=int, nargs="+", default=[0],
                        help="tree-verify variants: (query token, head) rows per tile (0 = the wrapper's choice, 64 "
                             "here; each other value adds a _m<N> row)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _tree_variants(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(row name, pages, warps, rows per tile) of the tree-verify variants `--tree-pages` x `--tree-warps` x
    `--tree-block-m` ask for (0: the wrapper's choice)."""
    return [("paged_tree_48" + (f"_p{p}" if p != 1 else "") + (f"_w{w}" if w else "") + (f"_m{m}" if m else ""), p, w, m)
            for p in args.tree_pages for w in args.tree_warps for m in args.tree_block_m]


def _cases(batch: int, ctx: int, device: str,
           tree_variants: tuple = (("paged_tree_48", 1, 0, 0),)) -> dict[str, tuple[Any, list[str], Any, Any]]:
    """name -> (module, kernel attrs, triton call, reference call) for one (batch, context) point."""
    import torch

    from tlt.kernels import paged_attention as pa
    from tlt.kernels import rmsnorm, rotary, tree_accept

    gen = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(batch, HIDDEN, device=device, dtype=bf, generator=gen)
    res = torch.randn(batch, HIDDEN, device=device, dtype=bf, generator=gen)
    w = torch.randn(HIDDEN, device=device, dtype=bf, generator=gen)
    q = torch.randn(batch, HQ, HEAD_DIM, device=device, dtype=bf, generator=gen)
    k = torch.randn(batch, HKV, HEAD_DIM, device=device, dtype=bf, generator=gen)
    pos = torch.full((batch,), ctx - 1, device=device, dtype=torch.int64)
    cos, sin = rotary.rope_cache(ctx, HEAD_DIM, 1e6, device=device)
    blocks = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    kc = torch.randn(batch * blocks, BLOCK_SIZE, HKV, HEAD_DIM, device=device, dtype=bf, generator=gen)
    vc = torch.randn(batch * blocks, BLOCK_SIZE, HKV, HEAD_DIM, device=device, dtype=bf, generator=gen)
    perm = torch.randperm(batch * blocks, device=device, generator=gen)
    tables = perm.view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    qt = torch.randn(batch, TREE_TOKENS, HQ, HEAD_DIM, device=device, dtype=bf, generator=gen)
    mask = torch.tril(torch.ones(TREE_TOKENS, TREE_TOKENS, device=device, dtype=torch.bool)).expand(batch, -1, -1).contiguous()
    nodes = torch.arange(TREE_TOKENS, device=device, dtype=torch.int64)
    draft = (nodes + 1).expand(batch, -1).contiguous()
    parents = (nodes - 1).expand(batch, -1).contiguous()
    target = (nodes + 2).expand(batch, -1).contiguous()  # a chain the target follows to the end
    return {
        "fused_add_rmsnorm": (rmsnorm, ["rmsnorm_kernel"], lambda: rmsnorm.fused_add_rmsnorm_triton(x, res, w, 1e-6),
                              lambda: rmsnorm.fused_add_rmsnorm_ref(x, res, w, 1e-6)),
        "rotary": (rotary, ["rotary_kernel"], lambda: rotary.apply_rotary_triton(q, k, pos, cos, sin),
                   lambda: rotary.apply_rotary_ref(q, k, pos, cos, sin)),
        "paged_decode": (pa, ["paged_attention_kernel", "merge_splits_kernel"],
                         lambda: pa.paged_decode_attention_triton(q, kc, vc, tables, lens, scale),
                         lambda: pa.paged_decode_attention_ref(q, kc, vc, tables, lens, scale)),
        **{name: (pa, ["paged_attention_kernel", "merge_splits_kernel"],
                  lambda pages=pages, warps=warps, rows=rows: pa.paged_tree_attention_triton(
                      qt, kc, vc, tables, lens, scale, mask, pages=pages, num_warps=warps or None, block_m=rows or None),
                  lambda: pa.paged_tree_attention_ref(qt, kc, vc, tables, lens, scale, mask))
           for name, pages, warps, rows in tree_variants},
        "tree_accept_48": (tree_accept, ["tree_accept_kernel"], lambda: tree_accept.tree_accept_triton(draft, parents, target),
                           lambda: tree_accept.tree_accept_ref(draft, parents, target)),
    }


def _compile_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import contextlib

    from tlt.kernels.compile_check import compile_recorded, ptxas_usage, record_launch

    rows = []
    for batch in args.batch:
        for ctx in args.ctx:
            for name, (module, attrs, call, _) in _cases(batch, ctx, "cpu", _tree_variants(args)).items():
                with contextlib.ExitStack() as stack:
                    recorders = [stack.enter_context(record_launch(module, attr)) for attr in attrs]
                    call()
                for recorder in recorders:
                    for launch in recorder.launches:
                        usage = ptxas_usage(compile_recorded(recorder.kernel, launch, arch=args.arch))
                        rows.append({"kernel": name, "launch": recorder.kernel.raw.__name__, "batch": batch, "ctx": ctx,
                                     "arch": args.arch, "grid": list(launch.grid), "registers": usage.registers,
                                     "spill_store_bytes": usage.spill_store_bytes, "spill_load_bytes": usage.spill_load_bytes})
    return rows


def _timed_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    from triton.testing import do_bench

    rows = []
    for batch in args.batch:
        for ctx in args.ctx:
            refs: dict[str, Any] = {}  # the tree variants share one reference (timed once)
            for name, (_, _, fast, slow) in _cases(batch, ctx, "cuda", _tree_variants(args)).items():
                base = "paged_tree_48" if name.startswith("paged_tree_48") else name
                got = fast()
                if base not in refs:
                    refs[base] = (slow(), do_bench(slow, return_mode="median") * 1000)
                want, ref_us = refs[base]
                pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
                if name.startswith("tree_accept"):
                    pairs = [(got.accept_len, want.accept_len), (got.path, want.path), (got.bonus, want.bonus)]
                for a, b in pairs:
                    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
                kernel_us = do_bench(fast, return_mode="median") * 1000  # do_bench returns the mean by default
                row = {"kernel": name, "batch": batch, "ctx": ctx, "triton_us": round(kernel_us, 2),
                       "torch_us": round(ref_us, 2), "speedup": round(ref_us / kernel_us, 2)}
                if name == "paged_decode" or base == "paged_tree_48":
                    kv_bytes = 2 * batch * ctx * HKV * HEAD_DIM * 2  # K and V, bf16, each read once at best
                    row["kv_read_GBps"] = round(kv_bytes / (kernel_us * 1e-6) / 1e9, 1)
                rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    if args.compile_only:
        rows = _compile_rows(args)
    elif not torch.cuda.is_available():
        print("no CUDA GPU: kernel timings need one (use --compile-only for a resource report)")
        return 2
    else:
        rows = _timed_rows(args)
    for row in rows:
        print("  ".join(f"{key}={value}" for key, value in row.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
