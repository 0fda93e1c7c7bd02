"""The real native engine with a scripted next-token choice, for tests/test_rollout_scripted_tools.py.

A random tiny model never writes a `<tool_call>` block. `ScriptedEngine` is `LLMEngine` itself (the replica runs it
as `[rollout] backend = "scripted_engine:ScriptedEngine"`) with one difference: after the model's real forward,
the logits of a scripted sequence are raised at the token its script says comes next, so the real sampler picks
that token. Everything else is the engine's own: scheduling, the forward, sampling, logprobs (of the raised
logits), stop checks, StepOutputs, CompletionOutputs, and everything the replica and the server do with them.

The scripts come from the environment (the replica is a spawned process that inherits it):
TLT_TEST_SCRIPTED_REPLIES holds a JSON list of [key, text]. A request whose decoded prompt holds a key writes that
key's text, tokenized by the checkpoint's tokenizer, then EOS; when several keys occur, the one that occurs last in
the prompt wins (a later turn's tool result beats the first user message). A prompt with no key is left to the
model. The seam is `self.runner.run`, wrapped on this instance: no production code is changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from tlt.services.rollout.engine.engine import LLMEngine

SCRIPT_ENV = "TLT_TEST_SCRIPTED_REPLIES"
MARGIN = 50.0  # the scripted token's logit over the row's best: greedy picks it, sampling all but surely


class ScriptedEngine(LLMEngine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scripts: list[tuple[str, list[int]]] = [
            (key, self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id])
            for key, text in json.loads(os.environ[SCRIPT_ENV])]
        self._forced: dict[str, list[int]] = {}  # request id -> the tokens its samples write
        real_run = self.runner.run

        def scripted_run(batch: Any) -> Any:
            out = real_run(batch)
            rows = [(i, self._forced[s.request_id]) for i, s in enumerate(out.emit_seqs) if s.request_id in
                    self._forced]
            if not rows:
                return out
            with torch.inference_mode():
                logits = out.logits.clone()
                for i, script in rows:
                    k = out.emit_seqs[i].num_output  # tokens this sample has written so far
                    target = script[min(k, len(script) - 1)]
                    logits[i, target] = logits[i].max() + MARGIN
            return dataclasses.replace(out, logits=logits)

        self.runner.run = scripted_run

    def add_request(self, req: Any) -> None:
        super().add_request(req)
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        found = [(prompt.rfind(key), ids) for key, ids in self._scripts if key in prompt]
        if found:
            self._forced[req.request_id] = max(found, key=lambda f: f[0])[1]

    def abort_request(self, request_id: str) -> None:
        super().abort_request(request_id)
        self._forced.pop(request_id, None)

    def step(self) -> Any:
        steps, done = super().step()
        for c in done:
            if not self.holds(c.request_id):
                self._forced.pop(c.request_id, None)
        return steps, done
