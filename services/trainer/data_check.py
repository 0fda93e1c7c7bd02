"""`tlt data check --data FILE`: know a prompt file is right before a training run starts.

    preset [trainer] + [rollout] <- TLT_TRAINER__* / TLT_ROLLOUT__* <- --set SECTION.FIELD=VALUE <- --data / --model
        / --answer-field                                    (load_config: as `tlt train` and `tlt rollout serve` do)
      -> trainer_prompts(cfg): the very PromptItems the trainer trains on (data.py); a DataError is the trainer's,
         word for word
      -> each prompt encoded as the rollout server encodes prompt text (tokenizer.encode: special tokens added)
      -> a report: rows, prompt kind, answers, columns, prompt tokens, prompts that leave no room for max_tokens
         under the rollout's max_model_len, duplicates; --show N: the first N prompts as the model sees them
      -> with eval_problems > 0 and an eval_data_path: eval_items(cfg), the trainer's eval set (its first
         eval_problems rows; evaluate.py), refused as the trainer refuses it, its rows and too-long prompts reported

Without it a bad row or a wrong answer_field showed only after minutes of service start-up, and a prompt too long
for the rollout's context only at the step that drew it: the rollout server refuses a request holding one
(INVALID_ARGUMENT), and the trainer stops there. The same holds for the eval file, read when the trainer starts
and sent at its first eval.

Exit status: 0 usable; 1 usable with warnings that stop or spoil a run: prompts that leave fewer than
[trainer] max_tokens tokens under max_model_len (the step that draws one fails; an eval prompt: the eval fails),
the same prompt with different answers (the reward contradicts itself); 2 refused (the trainer's DataError, of
the data or the eval file, a ConfigError, no tokenizer in the model folder). Identical duplicate rows are counted
but do not warn: they only weigh a prompt more in an epoch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHOWN_ANSWERS = 3  # answers printed as a sample of the answer field
NAMED_ROWS = 5  # rows named per finding (too long, conflicting answers)
PROGRESS_MIN_ROWS = 2000  # a file this long gets a progress bar while its prompts are tokenized
ENCODE_CHUNK = 1000  # prompts encoded per call (a fast tokenizer encodes a list in one call)
SECTIONS = ("trainer", "rollout")  # what --set may override: the two sections the figures come from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import at_least, non_empty  # '' was taken for the default; --show -1 for 0

    parser.epilog = ("Checks [trainer] eval_data_path too (its first eval_problems rows) when eval_problems > 0. "
                     "Exit status: 0 usable; 1 usable with warnings (prompts leaving fewer than max_tokens tokens "
                     "under the rollout's max_model_len; the same prompt with different answers); 2 refused, with "
                     "the trainer's own message (a bad row, a wrong answer_field, a bad eval file, a bad config, no "
                     "tokenizer).")
    parser.add_argument("--data", type=non_empty, default=None, metavar="FILE",
                        help="prompt file to check, JSONL / JSON array / Parquet (default: [trainer] data_path)")
    parser.add_argument("--model", type=non_empty, default=None, metavar="DIR",
                        help="policy checkpoint folder whose tokenizer (and chat template) counts and renders the "
                        "prompts (default: [trainer] model_dir; `tlt run` trains [run] model_dir, pass that one)")
    parser.add_argument("--answer-field", type=non_empty, default=None, metavar="PATH",
                        help="field of a row holding the reference answer; a dotted path reaches into a nested "
                        "field, e.g. reward_model.ground_truth (default: [trainer] answer_field)")
    parser.add_argument("--preset", default="cpu-tiny",
                        help="preset name or .toml path whose [trainer] and [rollout] sections the run uses "
                        "(default cpu-tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a preset value, e.g. trainer.max_tokens=512 or rollout.engine.max_model_len="
                        "4096; repeatable")
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object (on a refusal: status and error)")
    parser.add_argument("--show", type=at_least(0), default=0, metavar="N",
                        help="also print the first N prompts as the model sees them (chat rows rendered)")


@dataclass
class DataReport:
    """What `tlt data check` found; `asdict` of it is the --json output."""

    status: str  # "ok" | "warn"
    file: str
    model_dir: str
    rows: int
    prompt_kind: str  # "text" | "chat messages"
    answer_field: str
    answers: list[str]  # the first few
    distinct_answers: int
    columns: dict[str, int]  # each column reaching reward functions -> rows holding it
    prompt_tokens: dict[str, int]  # min, p50, p99, max
    max_model_len: int
    max_tokens: int
    too_long: dict[str, Any]  # count, rows (the first few, "file:line")
    duplicates: dict[str, Any]  # count (rows repeating an earlier prompt), conflicting (prompts with >1 answer), rows
    warnings: list[str] = field(default_factory=list)
    shown: list[dict[str, Any]] = field(default_factory=list)
    # the eval file as the trainer reads it (None: no eval_data_path, or eval_problems = 0): file, rows (in the
    # file), evaluated (its first eval_problems), prompt_kind, answer_field, prompt_tokens, too_long (of those)
    eval: dict[str, Any] | None = None


def section_overrides(pairs: list[str]) -> dict[str, dict[str, Any]]:
    """--set SECTION.FIELD=VALUE -> {section: {field: value}}, nested for rollout.engine.FIELD (as `tlt run`)."""
    from tlt.services.common.config import ConfigError, cli_overrides

    out: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in cli_overrides(pairs).items():
        parts = key.split(".")
        if len(parts) < 2 or parts[0] not in SECTIONS:
            raise ConfigError(f"override {key!r}: name a section, SECTION.FIELD=VALUE, with SECTION one of "
                              f"{', '.join(SECTIONS)} (e.g. trainer.max_tokens=512, rollout.engine.max_model_len=4096)")
        node = out[parts[0]]
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def resolve(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(TrainerConfig, RolloutConfig, the [sglang] config or None) as the run's services resolve them, the
    command's flags last."""
    from tlt.services.common.config import ConfigError, load_config
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.trainer.config import TrainerConfig

    over = section_overrides(args.overrides)
    flags = {k: v for k, v in {"data_path": args.data, "model_dir": args.model, "answer_field": args.answer_field}
             .items() if v is not None}  # a flag not given leaves --set's value (its None replaced it)
    trainer = load_config(TrainerConfig, "trainer", args.preset, {**over["trainer"], **flags}, require_section=True)
    rollout = load_config(RolloutConfig, "rollout", args.preset, over["rollout"])
    if not trainer.data_path:
        raise ConfigError("no data file to check: give --data FILE, or set [trainer] data_path in the preset")
    sglang = None
    if rollout.backend == "sglang":
        from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig

        sglang = load_config(SGLangBackendConfig, "sglang", args.preset)  # its draft slots take context
    return trainer, rollout, sglang


def load_tokenizer(model_dir: str) -> Any:
    """The policy's tokenizer, as the rollout server loads it; a ConfigError (one line) when the folder has none."""
    from tlt.services.common.config import ConfigError

    if not Path(model_dir).is_dir():
        raise ConfigError(f"model_dir {model_dir} is not a folder: give the policy checkpoint with --model DIR or "
                          "[trainer] model_dir")
    from transformers import AutoTokenizer

    from tlt.model.folder import TOKENIZER_FILES, has_tokenizer

    if not has_tokenizer(model_dir):  # transformers may load an empty tokenizer: every prompt 0 tokens, "ok"
        raise ConfigError(f"model_dir {model_dir} holds no tokenizer files ({' / '.join(TOKENIZER_FILES)}) to count "
                          "prompt tokens with; give the policy checkpoint with --model DIR")
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model_dir {model_dir} holds no tokenizer to count prompt tokens with "
                          f"({' '.join(str(e).split())}); give the policy checkpoint with --model DIR") from None


def context_length(model_dir: str, rollout: Any, sglang: Any = None) -> int:
    """What prompt + max_tokens may take, as the engine takes it: the native engine's max_model_len (0: the
    model's own, engine/config.py context_limit); the SGLang backend's max_position_embeddings less the draft
    slots SGLang reserves per request with an EAGLE drafter (`sglang`, its [sglang] config)."""
    from tlt.services.common.config import ConfigError

    if rollout.backend == "native":
        from tlt.model.folder import read_model_config
        from tlt.services.rollout.engine.config import context_limit

        return context_limit(rollout.engine.max_model_len, read_model_config(model_dir))
    reserved = 0
    if sglang is not None:
        from tlt.services.rollout.sglang_backend.launch import reserved_tokens

        reserved = reserved_tokens(sglang)
    from transformers import AutoConfig

    try:
        n = getattr(AutoConfig.from_pretrained(model_dir, local_files_only=True), "max_position_embeddings", None)
    except (OSError, ValueError):
        n = None
    if not n:
        raise ConfigError(f"the rollout's context length is the model's max_position_embeddings, and {model_dir} "
                          "has no config.json giving it")
    return int(n) - reserved


def row_labels(path: str, answer_field: str) -> list[str]:
    """Each row's "file:line" / "file item i" / "file row i", as DataError messages name it (row i is item i:
    the reader skips blank lines only)."""
    from tlt.services.trainer.data import file_rows

    return [where for _, where in file_rows(path, answer_field)]


def prompt_lengths(tok: Any, texts: list[str]) -> list[int]:
    """Tokens of each prompt as the rollout server encodes prompt text (grpc_api: tokenizer.encode(text), special
    tokens added); a progress bar on stderr for a long file."""
    from tqdm import tqdm

    out: list[int] = []
    with tqdm(total=len(texts), desc="prompt tokens", unit="prompt", file=sys.stderr, dynamic_ncols=True,
              disable=len(texts) < PROGRESS_MIN_ROWS) as bar:
        for start in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[start : start + ENCODE_CHUNK]
            out += [len(ids) for ids in tok(chunk, add_special_tokens=True)["input_ids"]]
            bar.update(len(chunk))
    return out


def nearest_rank(ordered: list[int], p: float) -> int:
    """The p-th percentile by nearest rank: a length some prompt has (p50 of 4 prompts is the 2nd shortest)."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def duplicates(prompts: list[str], answers: list[str], where: list[str]) -> dict[str, Any]:
    """Rows repeating an earlier row's prompt; of those prompts, how many have more than one answer, and the
    rows whose answer differs from the prompt's first."""
    first: dict[str, str] = {}
    answers_of: dict[str, set[str]] = {}
    clashing: list[str] = []
    for prompt, answer, w in zip(prompts, answers, where):
        first.setdefault(prompt, answer)
        answers_of.setdefault(prompt, set()).add(answer)
        if answer != first[prompt]:
            clashing.append(w)
    return {"count": len(prompts) - len(first), "conflicting": sum(len(a) > 1 for a in answers_of.values()),
            "rows": clashing[:NAMED_ROWS]}


def check(trainer: Any, rollout: Any, sglang: Any = None, show: int = 0) -> DataReport:
    """The report on `trainer.data_path`; DataError / ConfigError when the trainer would refuse it."""
    from tlt.services.trainer.data import trainer_prompts

    from tlt.services.common.config import ConfigError
    from tlt.services.common.config_cmd import context_problem

    items = trainer_prompts(trainer)
    tok = load_tokenizer(trainer.model_dir)
    max_model_len = context_length(trainer.model_dir, rollout, sglang)
    if (problem := context_problem(trainer, rollout, max_model_len)) is not None:
        raise ConfigError(problem)  # no prompt fits at all: refused, as tlt config check and tlt run refuse it
    where = row_labels(trainer.data_path, trainer.answer_field)
    room = max_model_len - trainer.max_tokens  # the longest prompt the rollout takes with max_tokens
    lengths, ordered, too_long = _measure(tok, items, where, room)
    columns: dict[str, int] = {}
    for it in items:
        for name in it.extra:
            columns[name] = columns.get(name, 0) + 1
    dups = duplicates([it.prompt for it in items], [it.answer for it in items], where)
    report = DataReport(
        status="ok", file=str(trainer.data_path), model_dir=str(trainer.model_dir), rows=len(items),
        prompt_kind="text" if items[0].messages is None else "chat messages", answer_field=trainer.answer_field,
        answers=[it.answer for it in items[:SHOWN_ANSWERS]], distinct_answers=len({it.answer for it in items}),
        columns=columns,
        prompt_tokens={"min": ordered[0], "p50": nearest_rank(ordered, 50), "p99": nearest_rank(ordered, 99),
                       "max": ordered[-1]},
        max_model_len=max_model_len, max_tokens=trainer.max_tokens,
        too_long={"count": len(too_long), "rows": too_long[:NAMED_ROWS]}, duplicates=dups,
        shown=[{"row": where[i], "prompt": items[i].prompt, "tokens": lengths[i], "answer": items[i].answer}
               for i in range(min(show, len(items)))],
    )
    if too_long:
        report.warnings.append(_too_long(len(too_long), too_long[:NAMED_ROWS], trainer.max_tokens, max_model_len,
                                         room, "", "the step that draws it fails"))
    if dups["conflicting"]:
        report.warnings.append(
            f"different answers for {_prompts(dups['conflicting'])} in different rows: the same completion is "
            f"rewarded both ways; keep one answer per prompt (rows with another answer: {', '.join(dups['rows'])})")
    if trainer.eval_problems and trainer.eval_data_path:
        report.eval = check_eval(trainer, tok, room)
        if count := report.eval["too_long"]["count"]:
            report.warnings.append(_too_long(count, report.eval["too_long"]["rows"], trainer.max_tokens,
                                             max_model_len, room, " of the eval file", "the eval fails"))
    report.status = "warn" if report.warnings else "ok"
    return report


def check_eval(trainer: Any, tok: Any, room: int) -> dict[str, Any]:
    """The eval set as the trainer loads it (`eval_items`: its DataError, word for word): rows, prompt tokens, and
    the rows longer than `room` tokens among those it evaluates."""
    from tlt.services.trainer.evaluate import eval_items

    items = eval_items(trainer)
    answer_field = trainer.eval_answer_field or trainer.answer_field
    where = row_labels(trainer.eval_data_path, answer_field)
    _, ordered, too_long = _measure(tok, items, where, room)
    return {"file": str(trainer.eval_data_path), "rows": len(where), "evaluated": len(items),
            "prompt_kind": "text" if items[0].messages is None else "chat messages", "answer_field": answer_field,
            "prompt_tokens": {"min": ordered[0], "max": ordered[-1]},
            "too_long": {"count": len(too_long), "rows": too_long[:NAMED_ROWS]}}


def _measure(tok: Any, items: list[Any], where: list[str], room: int) -> tuple[list[int], list[int], list[str]]:
    """(each prompt's tokens, the same sorted, the rows of the prompts longer than `room` tokens)."""
    lengths = prompt_lengths(tok, [it.prompt for it in items])
    return lengths, sorted(lengths), [w for w, n in zip(where, lengths) if n > room]


def _too_long(count: int, rows: list[str], max_tokens: int, max_model_len: int, room: int, in_file: str,
              fails: str) -> str:
    """The warning for `count` prompts longer than `room` tokens (`rows`: the first few)."""
    return (f"no room for max_tokens {max_tokens} under max_model_len {max_model_len} in {_prompts(count)}{in_file} "
            f"(longer than {room} tokens): the rollout server refuses a request holding one and {fails}; shorten or "
            f"drop them, or raise [rollout.engine] max_model_len / lower [trainer] max_tokens ({', '.join(rows)}"
            f"{', ...' if count > NAMED_ROWS else ''})")


def _prompts(n: int) -> str:
    return f"{n} prompt{'s' if n != 1 else ''}"


def format_report(r: DataReport) -> str:
    """The human table."""
    t = r.prompt_tokens
    cols = ", ".join(f"{k} ({n}/{r.rows} rows)" if n != r.rows else k for k, n in r.columns.items()) or "none"
    lines = [
        f"data check: {r.file}: {'ok' if not r.warnings else f'{len(r.warnings)} warning(s)'}",
        f"  rows           {r.rows} (prompts: {r.prompt_kind})",
        f"  answer field   {r.answer_field}: {', '.join(r.answers)}{', ...' if r.rows > len(r.answers) else ''} "
        f"({r.distinct_answers} distinct)",
        f"  columns        {cols} (reach reward functions)",
        f"  prompt tokens  min {t['min']}  p50 {t['p50']}  p99 {t['p99']}  max {t['max']} (tokenizer of "
        f"{r.model_dir}, special tokens as the rollout server adds them)",
        f"  context        max_model_len {r.max_model_len} - max_tokens {r.max_tokens} = "
        f"{r.max_model_len - r.max_tokens} prompt tokens at most",
        f"  too long       {r.too_long['count']}" + (f": {', '.join(r.too_long['rows'])}" if r.too_long["rows"]
                                                      else ""),
        f"  duplicates     {r.duplicates['count']} (rows repeating an earlier prompt); "
        f"{r.duplicates['conflicting']} with different answers",
    ]
    if (e := r.eval) is not None:
        lines += [
            f"  eval           {e['file']}: {e['rows']} rows, the first {e['evaluated']} evaluated (eval_problems); "
            f"prompts: {e['prompt_kind']}; answer field {e['answer_field']}; prompt tokens min "
            f"{e['prompt_tokens']['min']}  max {e['prompt_tokens']['max']}",
            f"  eval too long  {e['too_long']['count']}" + (f": {', '.join(e['too_long']['rows'])}"
                                                            if e["too_long"]["rows"] else ""),
        ]
    lines += [f"warning: {w}" for w in r.warnings]
    for s in r.shown:
        lines += [f"--- {s['row']} ({s['tokens']} tokens, answer {s['answer']}) ---", s["prompt"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tlt.services.common.config import ConfigError
    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.data import DataError

    from tlt.model.loader import CheckpointError

    try:
        report = check(*resolve(args), show=args.show)
    except (DataError, ConfigError, CheckpointError) as e:  # the user's file, config or model: the message says
        get_logger("data").error("data_refused", error=str(e))
        if args.json:
            print(json.dumps({"status": "refused", "error": str(e)}))
        return 2
    print(json.dumps(asdict(report), ensure_ascii=False) if args.json else format_report(report))
    return 1 if report.warnings else 0
