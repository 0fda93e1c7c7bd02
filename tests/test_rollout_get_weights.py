"""gRPC `tlt.v1.Rollout/GetWeights`: the named tensors of the policy the replicas serve.

Before any push it answers the start checkpoint's tensors as version 0; after a policy push, exactly
the pushed tensors (same dtype and bits) with the pushed version. Unknown names get NOT_FOUND, a
request without the policy kind INVALID_ARGUMENT, and a caller without the control token (none, or a
wrong one) UNAUTHENTICATED, as for UpdateWeights. The drafter service fetches the target's
embedding and lm_head with it (tests/test_drafter_shared.py).

Real parts: the rollout server on 127.0.0.1 (one replica process, native engine), gRPC, the weight
format of `services/common/weights.py`, a tiny random Qwen2 built in code. Nothing is faked.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import safetensors.torch
import torch

from rollout_helpers import ServerThread, tiny_checkpoint
from tlt.services.rollout.client import RolloutClient
from tlt.v1 import common_pb2, rollout_pb2

TOKEN = "get-weights-token"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("get_weights_model"))


@pytest.fixture(scope="module")
def original(model_dir) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(model_dir / "model.safetensors"))


def pushed_policy(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full policy update: every tensor perturbed."""
    g = torch.Generator().manual_seed(3)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in original.items()}


def test_get_weights_serves_the_latest_policy_to_the_token_holder(model_dir, original, monkeypatch):
    monkeypatch.delenv("TLT_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("TLT_AUTH_TOKEN_FILE", raising=False)
    with ServerThread(model_dir, replicas=1, control_token=TOKEN) as s, \
            RolloutClient(s.grpc_address, control_token=TOKEN, timeout_s=60) as client:
        version, got = client.get_weights([EMBED, LM_HEAD])  # nothing pushed: the start checkpoint
        assert version == 0 and sorted(got) == sorted([EMBED, LM_HEAD])
        assert all(torch.equal(got[k], original[k]) for k in got)

        new = pushed_policy(original)
        assert client.update_weights(new, "policy", 1).ok
        version, got = client.get_weights([LM_HEAD, EMBED])
        assert version == 1
        for k in (EMBED, LM_HEAD):
            assert got[k].dtype == new[k].dtype and torch.equal(got[k], new[k]) and not torch.equal(got[k], original[k])
        version, got = client.get_weights(["model.norm.weight"])  # any tensor of the push, alone
        assert version == 1 and list(got) == ["model.norm.weight"] and torch.equal(got["model.norm.weight"],
                                                                                   new["model.norm.weight"])

        with pytest.raises(grpc.RpcError) as e:
            client.get_weights([EMBED, "model.no_such.weight"])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "model.no_such.weight" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            client.stub.GetWeights(rollout_pb2.GetWeightsRequest(names=[EMBED]), timeout=30,
                                   metadata=(("authorization", f"Bearer {TOKEN}"),)).__next__()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # no kind
        with pytest.raises(grpc.RpcError) as e:  # no name: a caller's bug, not an empty answer it takes for "none"
            client.stub.GetWeights(rollout_pb2.GetWeightsRequest(kind=common_pb2.WEIGHT_KIND_POLICY), timeout=30,
                                   metadata=(("authorization", f"Bearer {TOKEN}"),)).__next__()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at least one tensor name" in e.value.details()

        for token in ("", "wrong-token"):  # control plane: no token, a wrong token -> refused
            with RolloutClient(s.grpc_address, control_token=token, timeout_s=30) as other:
                with pytest.raises(grpc.RpcError) as e:
                    other.get_weights([EMBED])
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_get_weights_after_a_partial_push_serves_untouched_tensors_from_the_checkpoint(model_dir, original):
    """A policy push may carry only some tensors (a valid partial update); the replicas then serve the pushed ones
    and, for every other tensor, still the start checkpoint's. GetWeights must answer those too (the drafter
    service asks for the embedding and lm_head after every policy version), not NOT_FOUND."""
    head = original[LM_HEAD] * 1.5
    with ServerThread(model_dir, replicas=1, control_token=TOKEN) as s, \
            RolloutClient(s.grpc_address, control_token=TOKEN, timeout_s=60) as client:
        assert client.update_weights({LM_HEAD: head}, "policy", 1).ok
        version, got = client.get_weights([EMBED, LM_HEAD])
        assert version == 1 and list(got) == [EMBED, LM_HEAD]
        assert torch.equal(got[LM_HEAD], head) and torch.equal(got[EMBED], original[EMBED])
        with pytest.raises(grpc.RpcError) as e:  # a name neither pushed nor in the checkpoint is still unknown
            client.get_weights([LM_HEAD, "model.no_such.weight"])
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "model.no_such.weight" in e.value.details()


def tied_checkpoint(out_dir: Path, stored_head: bool) -> Path:
    """`tiny_checkpoint` with tie_word_embeddings=true; its weights file stores no lm_head.weight (as transformers
    saves a tied model) or, `stored_head`, one equal to the embedding (as some exporters write it)."""
    d = tiny_checkpoint(out_dir)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tensors = safetensors.torch.load_file(str(d / "model.safetensors"))
    tensors[LM_HEAD] = tensors[EMBED].clone()
    if not stored_head:
        del tensors[LM_HEAD]
    safetensors.torch.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("stored_head", [False, True])
def test_get_weights_of_a_tied_model_answers_lm_head_with_the_served_embedding(tmp_path, stored_head):
    """A tied model's head is its embedding. Its lm_head.weight was NOT_FOUND when the checkpoint stores no head;
    when it stores one, GetWeights answered that start head, stamped with the version of a later push that changed
    the embedding (the trainer's pushes of a tied model carry no head), while the replicas serve the new one."""
    model_dir = tied_checkpoint(tmp_path, stored_head)
    start = safetensors.torch.load_file(str(model_dir / "model.safetensors"))[EMBED]
    with ServerThread(model_dir, replicas=1, control_token=TOKEN) as s, \
            RolloutClient(s.grpc_address, control_token=TOKEN, timeout_s=60) as client:
        version, got = client.get_weights([LM_HEAD, EMBED])
        assert version == 0 and list(got) == [LM_HEAD, EMBED]
        assert torch.equal(got[LM_HEAD], start) and torch.equal(got[EMBED], start)
        new = start * 2.0
        assert client.update_weights({EMBED: new}, "policy", 1).ok
        version, got = client.get_weights([LM_HEAD, "model.norm.weight"])
        assert version == 1 and list(got) == [LM_HEAD, "model.norm.weight"]
        assert torch.equal(got[LM_HEAD], new)
        version, got = client.get_weights([EMBED, LM_HEAD])
        assert version == 1 and torch.equal(got[EMBED], new) and torch.equal(got[LM_HEAD], new)
