"""`kind = "python"`: a user's TRL-style reward function served per item.

    f(prompts, completions, **kw) -> list[float]       # [reward] function = "module:function"

The function is loaded when the server starts (`load_function`, as `[trainer] reward = "python"` loads it: the
module on PYTHONPATH or in the current directory) and called per item as the trainer calls it in-process
(`tlt.services.trainer.rewards._call`: by keyword when it names `completions`, else positionally), with
one-element lists: `prompts=[prompt]`, `completions=[completion]`, `answer` / `answers` = `[reference]`, and
each `ScoreRequest.metadata` entry as a one-element keyword list. Metadata values are decoded as the trainer's
`GrpcRewards` encodes a data row's columns: a text value as is, any other value (a number, true / false / null,
a list, a dict) as its JSON text with its key in `ScoreRequest.json_metadata_keys`. So a key listed there arrives
decoded and any other as its text: a text column "42" stays "42", a number column 42 arrives as 42.
No `completion_ids`: a request has text only.

The value becomes the reward (a finite number; `correct` is reward > 0, as in-process); a function that
returns None for the item (TRL's "does not apply"), anything but one finite number, or raises answers that
item ok=false with the reason: one item has no other function to score it.

The server calls the function from `workers` threads at once: it must be thread-safe, or set `workers = 1`.
"""

from __future__ import annotations

import json
from typing import Any

from tlt.services.trainer.rewards import RewardError, RewardFn, _FunctionBatch, load_function
from tlt.v1 import reward_pb2


class ItemError(Exception):
    """The function gave this item no reward; the message is the item's `error`."""


def decode_metadata(item: reward_pb2.ScoreRequest) -> dict[str, Any]:
    """The request's metadata as the data row held it (see the docstring)."""
    json_keys = set(item.json_metadata_keys)
    columns: dict[str, Any] = {}
    for key, value in item.metadata.items():
        if key not in json_keys:
            columns[key] = value
            continue
        try:
            columns[key] = json.loads(value)
        except ValueError as e:
            raise ItemError(f"metadata {key!r} is listed in json_metadata_keys but is not JSON: {e}") from None
    return columns


class FunctionScorer:
    """Scores one ScoreRequest with a TRL-style reward function: (reward, correct), or ItemError.

    The item goes through the trainer's own in-process path (`_FunctionBatch`, a batch of one), so a served
    function is called, checked and its errors worded exactly as `[trainer] reward = "python"` does."""

    def __init__(self, spec: str, fn: RewardFn | None = None) -> None:
        self.spec = spec
        self.fn = fn if fn is not None else load_function(spec)  # RewardFunctionError: a config error

    def __call__(self, item: reward_pb2.ScoreRequest) -> tuple[float, bool]:
        extra = decode_metadata(item)
        batch = _FunctionBatch([(self.fn, 1.0)], names=[self.spec])
        batch.submit(item.id, item.prompt, item.completion, item.reference, extra=extra)
        try:
            result = batch.results()[item.id]
        except RewardError as e:  # raised, returned None (no other function scores the item), or no finite number
            raise ItemError(str(e)) from e
        return result.reward, result.correct
