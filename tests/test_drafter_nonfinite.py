"""A drafter whose weights hold NaN or infinity is refused, pushed or loaded from a folder; the old one keeps serving.

A push of such weights (a diverged training step) was taken: every draft token was rejected and the acceptance
fell to 1.0 in silence, while a policy push of NaN weights is refused. Real parts: the rollout server on
127.0.0.1 with one replica speculating with a learned (random) drafter, pushed to over gRPC UpdateWeights.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.model.drafter import Drafter, DrafterConfig, DrafterError, load_drafter
from tlt.services.rollout.client import RolloutClient, WeightPushError
from tlt.v1 import rollout_pb2


def _drafter(model_dir, seed: int) -> Drafter:
    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    cfg = DrafterConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    torch.manual_seed(seed)
    return Drafter(cfg, weights["model.embed_tokens.weight"], weights["lm_head.weight"])


def test_a_non_finite_drafter_push_is_refused_and_the_old_drafter_serves(tmp_path) -> None:
    model_dir = tiny_checkpoint(tmp_path / "model")
    folder = tmp_path / "drafter"
    _drafter(model_dir, 3).save(folder)
    spec = {"mode": "adaptive", "drafter": "learned", "drafter_path": str(folder)}
    params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with ServerThread(model_dir, replicas=1, spec=spec) as s, RolloutClient(s.grpc_address, timeout_s=120) as client:
        before = client.generate("1+2=", params=params)[0]
        own = _drafter(model_dir, 4).state_dict()
        for bad in (float("nan"), float("inf")):
            poisoned = own["fc.weight"].clone()
            poisoned[0, 0] = bad
            with pytest.raises(WeightPushError, match="NaN or infinite"):
                client.update_weights({**own, "fc.weight": poisoned}, "drafter", 1)
        assert client.status().versions.drafter == 0  # the drafter loaded at start still serves
        after = client.generate("1+2=", params=params)[0]
        assert after.versions.drafter == 0 and list(after.token_ids) == list(before.token_ids)
        assert client.update_weights(own, "drafter", 1).ok  # finite: taken
        assert client.status().versions.drafter == 1


def test_a_drafter_folder_with_non_finite_weights_is_refused_at_load(tmp_path) -> None:
    model_dir = tiny_checkpoint(tmp_path / "model")
    drafter = _drafter(model_dir, 3)
    with torch.no_grad():
        drafter.fc.weight[1, 2] = float("nan")
    drafter.save(tmp_path / "drafter")
    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    with pytest.raises(DrafterError, match="fc.weight holds NaN or infinite"):
        load_drafter(tmp_path / "drafter", weights["model.embed_tokens.weight"], weights["lm_head.weight"])
