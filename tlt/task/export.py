"""`tlt task export`: write the synthetic task as JSONL, one problem per line.

Each line: {"prompt": ChatML text to complete, "question": the user turn,
"answer": reference answer, "steps": number of operations}. The trainer's
prompt loader and any external tool read this file.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least, out_file

    parser.add_argument("--n", type=at_least(0), required=True, help="number of problems")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (same seed, same problems)")
    parser.add_argument("--out", type=out_file, required=True, help="output JSONL file ('-' for stdout)")


def run(args: argparse.Namespace) -> int:
    import json
    import sys
    from pathlib import Path

    from tlt.task import format_prompt, generate_problems

    lines = [
        json.dumps({"prompt": format_prompt(p), "question": p.prompt, "answer": p.answer, "steps": p.steps})
        for p in generate_problems(args.n, args.seed)
    ]
    text = "".join(line + "\n" for line in lines)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    return 0
