"""`kind = "python"`: a user's TRL-style reward function served per item.

    f(prompts, completions, **kw) -> list[float]       # [reward] function = "module:function"

The function is loaded when the server starts (`load_function`, as `[trainer] reward = "python"` loads it: the
module on PYTHONPATH or in the current directory) and called per item as the trainer calls it in-process
(`tlt.services.trainer.rewards._call`: by keyword when it names `completions`, else positionally), with
one-element lists: `prompts=[prompt]`, `completions=[completion]`, `answer` / `answers` = `[reference]`, and
each `ScoreRequest.metadata` entry as a one-element keyword list. Metadata values are decoded as the trainer's
`GrpcRewards` encodes a data row's columns (a text value as is, any other value as JSON): a value that parses
as JSON arrives decoded (a list, a dict, a number, true / false / null), any other value as its text. So a
text column whose value reads as JSON (`"42"`, `"true"`) arrives as 42 / True: the map carries no types.
No `completion_ids`: a request has text only.

The value becomes the reward (a finite number; `correct` is reward > 0, as in-process); a function that
returns None for the item (TRL's "does not apply"), anything but one finite number, or raises answers that
item ok=false with the reason: one item has no other function to score it.

The server calls the function from `workers` threads at once: it must be thread-safe, or set `workers = 1`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from tlt.services.trainer.rewards import RewardError, RewardFn, _call, _check_value, load_function
from tlt.v1 import reward_pb2


class ItemError(Exception):
    """The function gave this item no reward; the message is the item's `error`."""


def decode_metadata(value: str) -> Any:
    """A metadata value as the data row held it, as far as `GrpcRewards`' encoding tells (see the docstring)."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return value
    return value if isinstance(decoded, str) else decoded  # a text value is never sent JSON-encoded


class FunctionScorer:
    """Scores one ScoreRequest with a TRL-style reward function: (reward, correct), or ItemError."""

    def __init__(self, spec: str, fn: RewardFn | None = None) -> None:
        self.spec = spec
        self.fn = fn if fn is not None else load_function(spec)  # RewardFunctionError: a config error

    def __call__(self, item: reward_pb2.ScoreRequest) -> tuple[float, bool]:
        columns = {k: [decode_metadata(v)] for k, v in item.metadata.items()}
        try:
            values = _call(self.fn, [item.prompt], [item.completion], [item.reference], columns)
            if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
                raise ItemError(f"reward function {self.spec} returned {values!r}; a list of 1 number is required")
            values = list(values)
        except ItemError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: this item's error
            raise ItemError(f"reward function {self.spec} raised {type(e).__name__}: {e}") from e
        if len(values) != 1:
            raise ItemError(f"reward function {self.spec} returned {len(values)} values for 1 completion")
        if values[0] is None:
            raise ItemError(f"reward function {self.spec} returned None for this completion (it does not score it); "
                            "a served function is the only one scoring the item, so it must return a number")
        try:
            reward = _check_value(item.id, values[0], f"reward function {self.spec}")
        except RewardError as e:
            raise ItemError(str(e)) from None
        return reward, reward > 0
