"""`tlt config show`: every field of a preset's sections as TOML, with its description and where its value comes
from (the work is in config_cmd.py).

    tlt config show [--preset P] [--set section.field=value ...] [SECTION ...]
"""

from __future__ import annotations

import argparse
import sys


def _section(text: str) -> str:
    """argparse `type` of a SECTION: one a preset can hold (`choices` refuses nargs='*' given none, Python 3.11)."""
    from tlt.services.common.config_cmd import SECTION_CLASSES, unknown_section

    if text not in SECTION_CLASSES:
        raise argparse.ArgumentTypeError(
            unknown_section(text, note="[rollout.engine] and [rollout.spec] come with rollout"))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.services.common.config_cmd import SECTION_CLASSES, UNSET

    parser.epilog = (
        "Values are resolved as the services resolve them: model defaults -> --preset -> TLT_<SECTION>__<FIELD> "
        "environment -> --set. Each field follows a comment with its description and, unless it is the default, "
        "where its value comes from. TOML has no null: a field that is unset (None) is printed commented out, as "
        f"`# field = {UNSET}`; leave it out to keep it unset. The output loads back as a preset (--preset FILE); "
        "`tlt run` then fills in each run's ports and paths.")
    parser.add_argument("--preset", default="cpu-tiny", help="config preset name or .toml path (default: cpu-tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a field, e.g. trainer.lr=3e-5 or rollout.engine.max_num_seqs=32; repeatable")
    parser.add_argument("sections", nargs="*", metavar="SECTION", type=_section,
                        help=f"sections to print: {', '.join(SECTION_CLASSES)} (default: all; [rollout.engine] and "
                        "[rollout.spec] come with rollout)")


def run(args: argparse.Namespace) -> int:
    from tlt.services.common.config_cmd import show

    sys.stdout.write(show(args.preset, args.overrides, args.sections))  # a ConfigError: tlt.cli's one line, exit 2
    return 0
