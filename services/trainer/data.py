"""Prompt data for RL: (prompt, answer) pairs, seeded epochs, a resumable position.

    JSONL (or one JSON array) / Parquet file -> rows -> PromptItem list
        'prompt': text, or a list of chat messages [{"role", "content"}] (TRL's conversational rows, verl's
                  rows), rendered once here with the policy's chat template (add_generation_prompt=True);
                  the messages are kept in `PromptItem.messages` for reward functions
        the answer: the field `answer_field` names ("answer"; a dotted path reaches into a nested field:
                  verl's "reward_model.ground_truth")
        the row's other fields -> `PromptItem.extra`, for reward functions (rewards.py)
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

import dataclasses
import hashlib
import io
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tlt.services.trainer.types import PromptItem


class DataError(ValueError):
    """The prompt file cannot be used; the message names the file, the line and the fix."""


# Keywords a reward function gets from the trainer itself (rewards.py): a column of that name could not go beside
# them. 'prompt' and the answer are the row's own fields, not extra columns.
RESERVED_COLUMNS = ("prompts", "completions", "answers", "completion_ids", "trainer_state")
ROLES = ("system", "user", "assistant")  # of a chat-message prompt's messages
Row = tuple[object, str]  # (the parsed row, where it is: "file:line" / "file row i")


def _messages(prompt: list, where: str) -> list[dict[str, Any]]:
    """A chat-message prompt, checked: a non-empty list of {role, content} with text content, ending with the user's
    message, or with an assistant message after one: a prefill the model continues (TRL's convention, `is_prefill`).
    """
    if not prompt:
        raise DataError(f"{where}: 'prompt' is an empty list; a chat prompt needs at least one message")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise DataError(f"{where}: 'prompt' message {i} must be an object with 'role' and 'content', "
                            f"got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: 'prompt' message {i} lacks {key!r}; every message needs 'role' and "
                                "'content'")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: 'prompt' message {i} has role {m['role']!r}; roles are {ROLES}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: 'prompt' message {i} 'content' must be a string, "
                            f"got {type(m['content']).__name__}")
    last = prompt[-1]["role"]
    if last == "assistant" and not any(m["role"] == "user" for m in prompt):
        raise DataError(f"{where}: 'prompt' ends with an assistant prefill but has no user message before it; a "
                        "prefill opens the answer to the user's message")
    if last not in ("user", "assistant"):
        raise DataError(f"{where}: 'prompt' ends with role {last!r}; the last message must be the user's (the model "
                        "answers it), or an assistant prefill the model continues")
    if not any(m["content"].strip() for m in prompt):  # refused as a blank text prompt is: no prompt at all
        raise DataError(f"{where}: 'prompt' is chat messages whose content is all empty; a prompt needs some text")
    return [dict(m) for m in prompt]


def is_prefill(messages: list[dict[str, Any]] | None) -> bool:
    """True when a chat prompt ends with an assistant message: the opening of the answer, which the model continues.

    As TRL does: the chat template leaves that turn open (`continue_final_message`, no generation prompt), and a reward
    function gets the prompt without it and each completion as that message's text + the generated text.
    """
    return bool(messages) and messages[-1]["role"] == "assistant"


def _answer(row: dict, answer_field: str, where: str) -> object:
    """The value at `answer_field` ("answer", or a dotted path such as "reward_model.ground_truth")."""
    parts = answer_field.split(".")
    value: object = row
    for depth, key in enumerate(parts):
        if not isinstance(value, dict):
            raise DataError(f"{where}: {'.'.join(parts[:depth])!r} is a {type(value).__name__}, not an object "
                            f"holding {key!r} (answer_field {answer_field!r})")
        if key not in value:
            raise DataError(f"{where}: no {'.'.join(parts[: depth + 1])!r} (answer_field {answer_field!r}); "
                            "set answer_field to the path of the reference answer in your rows")
        value = value[key]
    return value


def _item(index: int, row: object, where: str, answer_field: str = "answer") -> PromptItem:
    """A row -> PromptItem; a chat-message prompt is kept in `messages` (prompt "" until `_items` renders it)."""
    top = answer_field.split(".")[0]
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with 'prompt' and {top!r}, got {type(row).__name__}")
    missing = [k for k in dict.fromkeys(("prompt", top)) if k not in row]
    if missing:
        raise DataError(f"{where}: missing field(s) {missing}; every row needs 'prompt' (text or chat messages) and "
                        f"the answer at answer_field {answer_field!r}")
    prompt, messages = row["prompt"], None
    if isinstance(prompt, list):
        prompt, messages = "", _messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt.strip():  # a blank prompt is no prompt, as for the answer
        raise DataError(f"{where}: 'prompt' must be a non-empty string or a list of chat messages "
                        f"[{{\"role\": ..., \"content\": ...}}], got {prompt!r:.60}")
    answer = _answer(row, answer_field, where)
    # an empty answer, a null or a NaN (a missing value in many writers) is no answer: every sample would score 0
    if (answer is None or (isinstance(answer, str) and not answer.strip())
            or (isinstance(answer, float) and not math.isfinite(answer))):
        raise DataError(f"{where}: {answer_field!r} is empty ({answer!r}); every row needs the reference answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: {answer_field!r} must be a string or a number, got {type(answer).__name__}")
    # a dotted answer_field leaves its top-level field among the columns (verl's reward_model.style routes rewards)
    extra = {k: v for k, v in row.items() if k not in ("prompt", answer_field)}
    for name in RESERVED_COLUMNS:
        if name in extra:
            raise DataError(f"{where}: column {name!r} clashes with the reward function keyword {name}= (passed "
                            "by the trainer); rename the column")
    if "answer" in extra and answer_field.split(".")[0] != "answer":  # another column is the reference (answer=)
        raise DataError(f"{where}: column 'answer' clashes with the reward function keyword answer=, which carries "
                        f"the reference answer (answer_field {answer_field!r}); rename the column")
    texts = [prompt, answer] + [m.get("content") for m in messages or ()]
    for text in texts:  # half of a surrogate pair (cut-off emoji in scraped data) cannot go over gRPC as UTF-8
        if isinstance(text, str) and not _utf8(text):
            raise DataError(f"{where}: the prompt or answer holds text that is not valid Unicode (a lone surrogate, "
                            f"e.g. half an emoji: {text.encode('utf-8', 'backslashreplace')[:80]!r}); fix the row")
    # the other columns reach the reward too (a reward server's metadata is UTF-8): refused here, not after a rollout
    for name, value in extra.items():
        if (bad := _invalid_text({name: value})) is not None:
            raise DataError(f"{where}: column {name!r} holds text that is not valid Unicode (a lone surrogate, e.g. "
                            f"half an emoji: {bad.encode('utf-8', 'backslashreplace')[:80]!r}); fix the row")
    return PromptItem(index=index, prompt=prompt, answer=_answer_text(answer), extra=extra, messages=messages,
                      where=where)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _invalid_text(value: object) -> str | None:
    """A string in a JSON value (object keys included, nested at any depth) that is not valid Unicode, else None."""
    stack = [value]
    while stack:  # not recursive: a deeply nested row must not end in a RecursionError
        v = stack.pop()
        if isinstance(v, str):
            if not _utf8(v):
                return v
        elif isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(v.keys())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return None


def _items(rows: Iterable[Row], answer_field: str, model_dir: str | Path | None) -> list[PromptItem]:
    """Rows -> PromptItems, chat prompts rendered; one kind of prompt per file.

    A reward function gets one kind of `prompts` and `completions` per batch (TRL decides it from the first row):
    text, or message lists. A file mixing the two would hand it both.
    """
    items: list[PromptItem] = []
    wheres: list[str] = []
    for row, where in rows:
        item = _item(len(items), row, where, answer_field)
        if items and (item.messages is None) != (items[0].messages is None):
            kinds = ("text", "chat messages") if item.messages is None else ("chat messages", "text")
            raise DataError(f"{where}: 'prompt' is {kinds[0]}, and the first row's is {kinds[1]}; a file holds one "
                            "kind of prompt (reward functions get one kind): convert the text prompts to "
                            '[{"role": "user", "content": ...}] or the reverse')
        items.append(item)
        wheres.append(where)
    if items and items[0].messages is not None:
        render = chat_renderer(model_dir, wheres[0])
        items = [dataclasses.replace(it, prompt=render(it.messages, w)) for it, w in zip(items, wheres)]
    return items


def chat_renderer(model_dir: str | Path | None, where: str) -> Callable[[list[dict[str, Any]], str], str]:
    """`render(messages, where)` -> the prompt text the policy's chat template makes of them, with the generation
    prompt (the assistant turn's opening) added, or for a prefill (`is_prefill`) that assistant turn left open: what TRL's GRPOTrainer feeds its model for such a row (less a
    leading BOS token the tokenizer adds again when the rollout encodes the text).

    Rendered once at load time, so the rollout, the trainer and the checkpoint's data fingerprint all see one text.
    """
    if model_dir is None:
        raise DataError(f"{where}: 'prompt' is a list of chat messages; rendering it needs the policy's tokenizer "
                        "(model_dir: the trainer passes it; load_prompts(path, model_dir=...))")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise DataError(f"{where}: 'prompt' is a list of chat messages, and {model_dir} holds no tokenizer to render "
                        f"it with ({e})") from None
    if not tok.chat_template:
        raise DataError(f"{where}: 'prompt' is a list of chat messages, and the tokenizer in {model_dir} has no chat "
                        "template to render it with; add one (chat_template in tokenizer_config.json, or "
                        "chat_template.jinja) or give text prompts")
    from jinja2 import TemplateError

    # Llama 3's and Gemma's templates write the BOS token into the text, and the rollout server encodes prompt text
    # with the tokenizer's special tokens, BOS included: the model would see two (TRL encodes the rendered text
    # without special tokens). A tokenizer that adds BOS itself gets the text without the template's leading one.
    bos = tok.bos_token if tok.bos_token_id is not None and tok.encode("x")[:1] == [tok.bos_token_id] else None

    def render(messages: list[dict[str, Any]], at: str) -> str:
        try:
            if is_prefill(messages):  # the assistant turn stays open after the prefill's text
                text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
            else:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # a template that raises on a role it does not take (a system turn, ...)
            raise DataError(f"{at}: the chat template of {model_dir} refused the messages: {e}") from None
        return text[len(bos):] if bos and text.startswith(bos) else text

    return render


def _answer_text(answer: str | int | float) -> str:
    """The reference answer as text; a float with an integer value is written as that integer.

    pandas stores an int column with a missing value as float64 (so its Parquet holds 42.0), and some JSON
    writers emit 42.0: str() gave "42.0", which the task verifier refuses (int("42.0") raises) and which no
    integer answer string matches.
    """
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer)


def _widen_short_floats(table: Any) -> Any:
    """float16 / float32 columns as the float64 of their shortest decimal: to_pylist widens float32 0.1 to
    0.10000000149011612, and a reference answer "0.10000000149011612" scores every right completion 0. Top-level
    columns only (the answer is one): floats inside list or struct columns reach reward functions widened."""
    import numpy as np
    import pyarrow as pa

    for i, f in enumerate(table.schema):
        kind = np.float16 if pa.types.is_float16(f.type) else np.float32 if pa.types.is_float32(f.type) else None
        if kind is not None:
            values = [None if v is None else float(str(kind(v))) for v in table.column(i).to_pylist()]
            table = table.set_column(i, pa.field(f.name, pa.float64()), pa.array(values, pa.float64()))
    return table


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


def _json_array_rows(path: Path, text: str) -> Iterable[Row]:
    """A file holding one JSON array of rows (json.dump(rows, f, indent=2), pandas to_json(orient="records")).

    Read as JSONL, its first line "[" was refused as not valid JSON; a JSONL row is never an array, so a file
    that starts with "[" is read whole.
    """
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except (RecursionError, ValueError) as e:
        raise DataError(f"{path}: {_unreadable(e)}") from None
    return ((row, f"{path} item {i}") for i, row in enumerate(rows))


def jsonl_rows(path: Path) -> Iterable[Row]:
    """The rows of a JSONL file (or of one JSON array), each with its "file:line"."""
    text = _utf8_text(path)
    if text.lstrip().startswith("["):
        yield from _json_array_rows(path, text)
        return
    first = True
    # newline=None: the universal newlines a text-mode open() reads (\n, \r\n, \r)
    for lineno, line in enumerate(io.StringIO(text, newline=None), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if first:  # not JSONL at all: a pretty-printed object was refused as if its first line were a bad row
                raise DataError(_not_rows(path, text, f"{path}:{lineno}: not valid JSON ({e.msg})")) from None
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except (RecursionError, ValueError) as e:
            raise DataError(f"{path}:{lineno}: {_unreadable(e)}") from None
        first = False
        yield row, f"{path}:{lineno}"


def _not_rows(path: Path, text: str, bad_line: str) -> str:
    """What a JSON prompt file must hold, told when its first line is no whole JSON row."""
    expected = 'expected a JSON array of rows ([{"prompt": ..., "answer": ...}, ...]) or JSONL with one object per line'
    try:
        whole = json.loads(text)
    except (RecursionError, ValueError):
        return f"{bad_line}; {expected}"
    kind = "object" if isinstance(whole, dict) else "value"
    return f"{path}: one JSON {kind} over several lines, not rows; {expected}"


def _unreadable(e: RecursionError | ValueError) -> str:
    """Why valid JSON could not be read (json.loads raised a traceback for these, not a refusal)."""
    if isinstance(e, RecursionError):
        return "JSON nested too deeply to read"
    return f"not readable as JSON ({e})"  # an integer of more than sys.get_int_max_str_digits() digits


def parquet_rows(path: Path, answer_field: str = "answer") -> Iterable[Row]:
    """The rows of a Parquet file (structs -> dicts, lists -> lists: verl's chat prompts and reward_model),
    each with its "file row i"; a column holding what JSON cannot (bytes, dates, decimals) is refused."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or convert the file to JSONL)") from None
    import pyarrow as pa

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # not Parquet (a JSONL file so named), truncated, empty
        raise DataError(f"{path}: not a readable Parquet file ({e}); write it again, or name a JSONL file .jsonl") from None
    missing = [c for c in dict.fromkeys(("prompt", answer_field.split(".")[0])) if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; columns are {table.column_names}; answer_field "
                        f"names the answer's column ({answer_field!r} now)")
    for i, row in enumerate(_widen_short_floats(table).to_pylist()):
        # a JSONL row is JSON by construction; the other columns of a Parquet row reach reward functions as they are
        # (and the gRPC reward server as JSON text), so they must be JSON too. prompt and answer are checked by _item.
        for name, value in row.items():
            if name in ("prompt", answer_field):
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise DataError(f"{path} row {i}: column {name!r} holds a {type(value).__name__}, which is not JSON; "
                                "drop the column or convert it (text, numbers, lists, structs)") from None
        yield row, f"{path} row {i}"


def file_rows(path: str | Path, answer_field: str = "answer") -> Iterable[Row]:
    """The rows of a JSONL or Parquet prompt file (by extension), each with where it is."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompt file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return jsonl_rows(p)
    if suffix in (".parquet", ".pq"):
        return parquet_rows(p, answer_field)
    raise DataError(f"{p}: unknown prompt file type {suffix!r}; use .jsonl or .parquet")


def load_prompts(path: str | Path, answer_field: str = "answer",
                 model_dir: str | Path | None = None) -> list[PromptItem]:
    """Read a JSONL or Parquet prompt file (by extension): the answer at `answer_field` (a dotted path reaches into
    nested fields), chat-message prompts rendered with the chat template of the tokenizer in `model_dir`."""
    p = Path(path)
    items = _items(file_rows(p, answer_field), answer_field, model_dir)
    if not items:
        raise DataError(f"{p}: no prompts in the file")
    return items


def trainer_prompts(cfg) -> list[PromptItem]:  # noqa: ANN001 - TrainerConfig
    """The trainer's data set: `data_path` read with its `answer_field` and the policy's chat template, else the
    synthetic task. One function, for the trainer (loop.py) and `tlt run`'s resume check (launcher.py): a position
    in the data is a position in these very items (their fingerprint)."""
    if cfg.data_path:
        items = load_prompts(cfg.data_path, cfg.answer_field, cfg.model_dir)
        if cfg.reward == "task":  # the synthetic task's integer reader: refused now, not at the step that hits a row
            from tlt.services.trainer.rewards import task_reference_problem

            if (problem := task_reference_problem(items, cfg.data_path)) is not None:
                raise DataError(problem)
        return items
    return synthetic_prompts(cfg.synthetic_problems, cfg.seed)


def synthetic_prompts(n: int, seed: int) -> list[PromptItem]:
    """The embedded default data set: the synthetic long-tail task, ChatML prompts."""
    from tlt.task import format_prompt, generate_problems

    return [PromptItem(i, format_prompt(p), p.answer) for i, p in enumerate(generate_problems(n, seed))]


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0  # items of this epoch's permutation already handed out


def items_fingerprint(items: list[PromptItem]) -> str:
    """sha256 of prompt items in order (each one's prompt, answer and extra columns, which reward functions read,
    and its chat messages when it has them): the same hex digest for the same content, whatever file it came from."""
    h = hashlib.sha256()
    for item in items:
        fields = [item.prompt, item.answer, item.extra] + ([item.messages] if item.messages is not None else [])
        h.update(json.dumps(fields, sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


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
        import torch  # here, not at the top: the reward server imports this module (its prompt types) and not torch

        from tlt.services.common.seeds import torch_seed

        gen = torch.Generator().manual_seed(torch_seed(self.seed * 1_000_003 + epoch))
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
        """`items_fingerprint` of the items: a position is a position in this content.

        Without it a data file edited to the same number of prompts resumed silently into other prompts.
        One pass over the text at the first save or resume (about 0.1 s for 100 MB of prompts).
        """
        return items_fingerprint(self.items)

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
