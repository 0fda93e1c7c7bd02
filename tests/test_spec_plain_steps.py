"""What `plain_steps` (SpecStatus.plain_steps, rollout_spec_plain_steps_total) counts: the engine steps that emitted
tokens without speculating, a prompt's last prefill chunk (which samples its first token) among them. A prefill
chunk that emits nothing is in neither plain_steps nor verify_steps (it is in the engine's steps_run): the metric
said "prefill included", and a chunked 100-token prompt's 11 engine steps read 5 plain + 0 verify.

Real parts: the native engine with the adaptive decoder (n-gram drafter) on a tiny random checkpoint, and the
Prometheus registry /metrics renders.
"""

from __future__ import annotations

import math

from spec_decoder_helpers import ckpt  # noqa: F401 - the module's checkpoint fixture

from tlt.services.common.metrics import Metrics
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec_metrics import SpecMetrics
from tlt.services.rollout.types import GenerationRequest, SamplingParams


def test_plain_steps_are_the_steps_that_emitted_without_speculating(ckpt):  # noqa: F811
    chunk, prompt, max_tokens = 16, 100, 5
    eng = LLMEngine(ckpt, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=chunk))
    eng.enable_spec(SpecConfig(mode="adaptive", threshold=16, drafter="ngram"))
    eng.add_request(GenerationRequest("r", tuple(range(5, 5 + prompt)),
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 1))
    while eng.has_unfinished():
        eng.step()
    st = eng.spec_decoder.stats()
    silent = math.ceil(prompt / chunk) - 1  # chunks before the last: they emit nothing
    assert st["verify_steps"] + st["plain_steps"] + silent == eng.steps_run
    assert st["plain_steps"] >= 1  # the last chunk, which sampled the first token

    metrics = Metrics("rollout")
    SpecMetrics(metrics).update(0, st)
    help_line = next(line for line in metrics.render().decode().splitlines()
                     if line.startswith("# HELP rollout_spec_plain_steps_total"))
    assert "prefill included" not in help_line and "emits nothing" in help_line, help_line
