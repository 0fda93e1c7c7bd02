"""`tlt config check FILE`: every section of a preset file validated by its config class, starting nothing (the
work is in config_cmd.py).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Each section is loaded as its service would load it, the environment left out: unknown "
                     "sections, unknown fields, bad values, a [trainer] max_tokens that leaves no room for a "
                     "prompt under [rollout.engine] max_model_len and a pushed weight dtype ([trainer] push_dtype, "
                     "bf16) that is not [rollout.engine] dtype are printed, exit status 2; else 'ok: N sections'.")
    parser.add_argument("file", metavar="FILE", help="preset name or .toml path")


def run(args: argparse.Namespace) -> int:
    from tlt.services.common.config import ConfigError, preset_path
    from tlt.services.common.config_cmd import check

    try:
        n = check(args.file)
    except ConfigError as e:  # the result of the check, not a usage error: the whole text, as it reads
        print(e, file=sys.stderr)
        return 2
    print(f"ok: {n} section{'s' if n != 1 else ''} in {preset_path(args.file)}")
    return 0
