"""Test support for the drafter integration test: a native engine with EAGLE speculative decoding on.

`SpecEngine` is the real native `LLMEngine` with `enable_spec` called on it (static chain arm, the
learned drafter loaded from $TLT_TEST_DRAFTER_PATH, sharing the target's embed/lm_head), used as
the rollout backend "drafter_helpers:SpecEngine" so that the server accepts
UpdateWeights(kind=drafter) and stamps completions with the drafter version. Nothing is faked:
it only does the wiring that an engine-config switch would do.
"""

from __future__ import annotations

import os

from tlt.services.rollout.engine.engine import LLMEngine


class SpecEngine(LLMEngine):
    def __init__(self, model_dir, config, replica_id: int = 0) -> None:  # noqa: ANN001
        super().__init__(model_dir, config, replica_id=replica_id)
        from tlt.services.rollout.spec.config import SpecConfig
        from tlt.services.rollout.spec.decoder import build_spec_decoder

        spec = SpecConfig(mode="static", static_arm=os.environ.get("TLT_TEST_SPEC_ARM", "4_1_5"), drafter="learned",
                          drafter_path=os.environ["TLT_TEST_DRAFTER_PATH"], threshold=64, hysteresis_steps=1)
        self.spec_decoder = build_spec_decoder(spec, self.runner, self.block_manager)
        self.scheduler.on_release = self.spec_decoder.release
