"""Engine backends a replica can run, all behind the `LLMEngine` interface.

    native  -> tlt.services.rollout.engine.engine:LLMEngine          (default; CPU and GPU)
    sglang  -> tlt.services.rollout.sglang_backend.engine:SGLangEngine (GPU, optional `sglang` extra)
    "package.module:Class"                                          (any class with the same interface)

The interface (see `services/rollout/engine/engine.py`): constructed as
`Engine(model_dir, engine_config, replica_id=i)`, with `tokenizer`,
`model_config`, `max_model_len`, `versions`, `add_request`, `abort_request`,
`holds` (a request still has sequences there), `step`, `has_unfinished`,
`load` (running, queued, KV use; read after every step), `stats`,
`expected_weights`, `update_weights`; optionally `unfinished_emitted()` ((request id, sample index, tokens
emitted) of each unfinished sequence: with `[rollout] features_push`, where a policy push cuts their drafter
features; without it a sequence a push spans sends features only if its completion has no `policy_min`),
`release()` / `resume()`, which free
device memory while a colocated trainer has borrowed the device and take it back
(`Rollout.LendDevices`; called only when the engine holds no sequences). An engine whose `add_request` runs
only a request's `sample_indices` (each with the seed it has in the whole request) says so with a class
attribute `runs_sample_subsets = True`: the pool then re-issues just the unfinished samples of a request whose
replica died (replicas.py); without it only requests none of whose samples had finished are re-issued.
"""

from __future__ import annotations

import importlib
from typing import Any

BACKENDS = {
    "native": "tlt.services.rollout.engine.engine:LLMEngine",
    "sglang": "tlt.services.rollout.sglang_backend.engine:SGLangEngine",
}


def engine_class(backend: str) -> Any:
    """Import and return the engine class of a backend name or a 'module:Class' path."""
    target = BACKENDS.get(backend, backend)
    if ":" not in target:
        raise ValueError(f"unknown rollout backend {backend!r}; use one of {sorted(BACKENDS)} or 'module:Class'")
    module, name = target.split(":", 1)
    return getattr(importlib.import_module(module), name)
