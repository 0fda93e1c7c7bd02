"""Peak CPU memory of one forward + backward of the trainer's response_logprobs at a large vocabulary.

    .venv/bin/python tests/logits_memory.py 1024 2048 4096 --chunks 0 1024

A 1-layer, hidden-64 bf16 Qwen2 with Qwen2.5's vocabulary (152,064), B = 1, a 4-token prompt and R response tokens:
nearly all memory is the logits path. Each (R, chunk) runs in a fresh subprocess; its peak is the rise of ru_maxrss
over the forward + backward (the model already built). chunk 0 is the full-logits path ([B, R, V] at once).
Not a test (no test_ prefix): a measurement recorded in BENCHMARKS.md "Trainer memory".
"""

from __future__ import annotations

import argparse
import subprocess
import sys

V = 152064


def measure(r: int, chunk: int) -> None:
    import resource

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tlt.services.trainer.policy import TokenBatch, response_logprobs

    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    batch = TokenBatch.build([[1, 2, 3, 4]], [[5 + (i * 7919) % (V - 5) for i in range(r)]])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = response_logprobs(model, batch, temperature=1.0, with_entropy=True, chunk_tokens=chunk)
    (-out.logprobs.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(f"R={r} chunk={chunk}: peak {peak / 2**30:.2f} GiB = {peak / (r * V):.2f} bytes per response token x vocab")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lengths", type=int, nargs="+", help="response lengths R")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 1024])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        measure(args.lengths[0], args.chunks[0])
        return
    for chunk in args.chunks:
        for r in args.lengths:
            subprocess.run([sys.executable, __file__, str(r), "--chunks", str(chunk), "--one"], check=True)


if __name__ == "__main__":
    main()
