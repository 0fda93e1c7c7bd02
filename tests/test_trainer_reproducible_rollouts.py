"""`[trainer] reproducible_rollouts`: a redone step's samples under speculative decoding.

README said the trainer's seeded requests make a redone step sample the completions it first did on one CPU replica.
Under speculation the default sampled learned chains are verified by rejection sampling, whose tokens depend on
which steps speculate, with which arm and drafter: two fresh engines gave the same completions for 1 of 16 requests
(the audit's repro). With the option the step's requests are `reproducible` (the tree walk: plain decoding's tokens
for the same seeds). Shown deterministically: a speculating server (a static learned chain, sampled drafts) against
a plain one, the trainer's own params for a step, the same seeds.

Real parts: two rollout servers on 127.0.0.1 (native engine, one replica each), gRPC BatchGenerate; a random model
and a random EAGLE drafter built in code.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from rollout_helpers import ServerThread, tiny_checkpoint

from tlt.services.rollout.client import RolloutClient
from tlt.services.trainer.collect import server_params, training_params
from tlt.services.trainer.config import TrainerConfig


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from tlt.model.drafter import Drafter, DrafterConfig

    root = tmp_path_factory.mktemp("repro_rollouts")
    model = tiny_checkpoint(root / "model")
    weights = safetensors.torch.load_file(str(model / "model.safetensors"))
    torch.manual_seed(5)
    Drafter(DrafterConfig.from_hf(json.loads((model / "config.json").read_text())),
            weights["model.embed_tokens.weight"], weights["lm_head.weight"]).save(root / "drafter")
    spec = {"mode": "static", "static_arm": "4_1_5", "drafter": "learned", "drafter_path": str(root / "drafter")}
    with ServerThread(model, replicas=1, spec=spec) as speculating, \
            ServerThread(model, replicas=1, spec={"mode": "off"}) as plain:
        yield speculating, plain


def _completions(server: ServerThread, params) -> list[tuple[int, ...]]:  # noqa: ANN001 - SamplingParams
    with RolloutClient(server.grpc_address, timeout_s=120) as c:
        done = list(c.batch_generate(["1+2=", "3*4=", "10-7="], n=2, params=params))
    return sorted((d.prompt_index, d.sample_index, tuple(d.token_ids)) for d in done)


def _params(reproducible: bool):  # noqa: ANN202 - SamplingParams
    cfg = TrainerConfig(model_dir="unused", temperature=1.0, max_tokens=24, seed=7,
                        reproducible_rollouts=reproducible)
    return server_params(training_params(cfg), step=3, server=0)


def test_reproducible_rollouts_sample_plain_decodings_completions_under_speculation(servers) -> None:
    speculating, plain = servers
    params = _params(True)
    assert params.reproducible and params.HasField("seed")
    assert _completions(speculating, params) == _completions(plain, params)
    status = RolloutClient(speculating.grpc_address).status()
    assert status.replicas[0].spec.verify_steps > 0  # it did speculate


def test_by_default_a_speculating_step_samples_other_completions_of_the_same_seeds(servers) -> None:
    """The default (rejection-sampled chains, faster) is why the option exists; this is what README now says."""
    speculating, plain = servers
    params = _params(False)
    assert not params.reproducible
    assert _completions(speculating, params) != _completions(plain, params)
