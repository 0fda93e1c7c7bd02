"""Prompt data for RL: (prompt, answer) pairs, seeded epochs, a resumable position.

    JSONL (or one JSON array) / Parquet file (fields "prompt", "answer", any others) -> PromptItem list
        (the other fields of a row are kept in `PromptItem.extra` for reward functions: rewards.py)
    or the synthetic task (tlt.task.generate_problems) -> PromptItem list
    PromptSampler: epoch e visits every item once in permutation(seed, e);
                   next_batch(k) returns the next k items; state_dict() /
                   load_state_dict() restore the exact position (checkpoints),
                   refusing a state saved for another seed, prompt count or
                   content (`fingerprint`).

A batch never straddles two epochs silently: when an epoch runs out, the rest
of the batch comes from the start of the next epoch's permutation.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from tlt.services.trainer.types import PromptItem


class DataError(ValueError):
    """The prompt file cannot be used; the message names the file, the line and the fix."""


# Keywords a reward function gets from the trainer itself (rewards.py): a column of that name could not go beside
# them. 'prompt' and 'answer' are the row's own fields, not extra columns.
RESERVED_COLUMNS = ("prompts", "completions", "answers")


def _item(index: int, row: object, where: str) -> PromptItem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with 'prompt' and 'answer', got {type(row).__name__}")
    missing = [k for k in ("prompt", "answer") if k not in row]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing}; every row needs 'prompt' (text) and 'answer'")
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt.strip():  # a blank prompt is no prompt, as for 'answer'
        raise DataError(f"{where}: 'prompt' must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    # an empty answer or a NaN (a missing value in many writers) is no answer: every sample would score 0
    if (isinstance(answer, str) and not answer.strip()) or (isinstance(answer, float) and not math.isfinite(answer)):
        raise DataError(f"{where}: 'answer' is empty ({answer!r}); every row needs the reference answer")
    extra = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    for name in RESERVED_COLUMNS:
        if name in extra:
            raise DataError(f"{where}: column {name!r} clashes with the reward function keyword {name}= (the "
                            f"step's {name[:-1]} list, passed by the trainer); rename the column")
    return PromptItem(index=index, prompt=prompt, answer=_answer_text(answer), extra=extra)


def _answer_text(answer: str | int | float) -> str:
    """The reference answer as text; a float with an integer value is written as that integer.

    pandas stores an int column with a missing value as float64 (so its Parquet holds 42.0), and some JSON
    writers emit 42.0: str() gave "42.0", which the task verifier refuses (int("42.0") raises) and which no
    integer answer string matches.
    """
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer)


def _utf8_text(path: Path) -> str:
    """The file's text; a DataError naming the line of the first byte that is not UTF-8.

    Decoded whole, not by a text-mode file: that decodes ahead in chunks, so its error names no line.
    """
    data = path.read_bytes()
    data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data  # a BOM (Windows editors write one) is no data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start].decode("utf-8")
        lineno = before.replace("\r\n", "\n").replace("\r", "\n").count("\n") + 1
        raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason}); re-save the file as UTF-8") from None


def _load_json_array(path: Path, text: str) -> list[PromptItem]:
    """A file holding one JSON array of rows (json.dump(rows, f, indent=2), pandas to_json(orient="records")).

    Read as JSONL, its first line "[" was refused as not valid JSON; a JSONL row is never an array, so a file
    that starts with "[" is read whole.
    """
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    return [_item(i, row, f"{path} item {i}") for i, row in enumerate(rows)]


def load_jsonl(path: Path) -> list[PromptItem]:
    text = _utf8_text(path)
    if text.lstrip().startswith("["):
        return _load_json_array(path, text)
    items: list[PromptItem] = []
    # newline=None: the universal newlines a text-mode open() reads (\n, \r\n, \r)
    for lineno, line in enumerate(io.StringIO(text, newline=None), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        items.append(_item(len(items), row, f"{path}:{lineno}"))
    return items


def load_parquet(path: Path) -> list[PromptItem]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or convert the file to JSONL)") from None
    table = pq.read_table(path)
    missing = [c for c in ("prompt", "answer") if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; columns are {table.column_names}")
    items = [_item(i, row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]
    for item in items:  # a JSONL row is JSON by construction; a Parquet column may hold bytes, dates, decimals
        for name, value in item.extra.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise DataError(f"{path} row {item.index}: column {name!r} holds a {type(value).__name__}, which is "
                                "not JSON; drop the column or convert it (text, numbers, lists, structs)") from None
    return items


def load_prompts(path: str | Path) -> list[PromptItem]:
    """Read a JSONL or Parquet prompt file (by extension)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompt file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        items = load_jsonl(p)
    elif suffix in (".parquet", ".pq"):
        items = load_parquet(p)
    else:
        raise DataError(f"{p}: unknown prompt file type {suffix!r}; use .jsonl or .parquet")
    if not items:
        raise DataError(f"{p}: no prompts in the file")
    return items


def synthetic_prompts(n: int, seed: int) -> list[PromptItem]:
    """The embedded default data set: the synthetic long-tail task, ChatML prompts."""
    from tlt.task import format_prompt, generate_problems

    return [PromptItem(i, format_prompt(p), p.answer) for i, p in enumerate(generate_problems(n, seed))]


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # items of this epoch's permutation already handed out


class PromptSampler:
    """Seeded epoch iteration over a fixed list of prompts, with a resumable position."""

    def __init__(self, items: list[PromptItem], seed: int) -> None:
        if not items:
            raise DataError("no prompts to sample from")
        self.items = items
        self.seed = seed
        self.state = SamplerState()
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=gen).tolist()

    def next_batch(self, k: int) -> list[PromptItem]:
        out: list[PromptItem] = []
        while len(out) < k:
            if self.state.position >= len(self._perm):
                self.state = SamplerState(self.state.epoch + 1, 0)
                self._perm = self._permutation(self.state.epoch)
            take = min(k - len(out), len(self._perm) - self.state.position)
            out += [self.items[i] for i in self._perm[self.state.position : self.state.position + take]]
            self.state.position += take
        return out

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the items in order (each one's prompt, answer and extra columns, which reward functions
        read): a position is a position in this content.

        Without it a data file edited to the same number of prompts resumed silently into other prompts.
        One pass over the text at the first save or resume (about 0.1 s for 100 MB of prompts).
        """
        h = hashlib.sha256()
        for item in self.items:
            h.update(json.dumps([item.prompt, item.answer, item.extra], sort_keys=True, ensure_ascii=False).encode())
            h.update(b"\n")
        return h.hexdigest()

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.state.epoch, "position": self.state.position, "seed": self.seed, "size": len(self.items),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Restore a position; DataError when it was saved for other data (another seed, count or content).
        A state without a fingerprint (saved before it was kept) is checked on seed and count alone."""
        if state["seed"] != self.seed or state["size"] != len(self.items):
            raise DataError(
                f"checkpoint data position was for seed {state['seed']} and {state['size']} prompts, "
                f"now seed {self.seed} and {len(self.items)} prompts: resume with the same data and seed"
            )
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint:
            raise DataError(
                f"checkpoint data position was for {state['size']} prompts of other content (fingerprint "
                f"{str(saved)[:12]}, now {self.fingerprint[:12]}: the data file was edited, or reordered): "
                "resume with the same data and seed, or start a new run"
            )
        self.state = SamplerState(state["epoch"], state["position"])
        self._perm = self._permutation(self.state.epoch)
