"""`RolloutClient`: the trainer's small, synchronous gRPC client for the rollout service.

    from tlt.v1 import rollout_pb2
    client = RolloutClient("127.0.0.1:50051")
    for c in client.batch_generate(["1+2=", "3*4="], n=4, params=rollout_pb2.SamplingParams(max_tokens=64)):
        ...  # one tlt.v1.Completion per sequence, in finishing order, stamped with versions
    client.update_weights(model.state_dict(), kind="policy", version=3)   # raises WeightPushError if refused
    version, tensors = client.get_weights(["lm_head.weight"])   # what the replicas serve now (control plane)
    client.status()

Weights go through `services/common/weights.py` (manifest + chunks, or a
/dev/shm file on the same host with `shm=True`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

from tlt.services.common.auth import bearer, resolve_token
from tlt.services.common.channels import client_options, keepalive_options
from tlt.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

# 256 MiB messages (weight pushes); own connection, reconnect back-off capped at 1 s (channels.py)
_OPTIONS = client_options(256 << 20)
_KINDS = {"policy": common_pb2.WEIGHT_KIND_POLICY, "drafter": common_pb2.WEIGHT_KIND_DRAFTER}


class ControlRefusedError(RuntimeError):
    """The rollout server would refuse this client's control-plane calls (its token is missing or wrong)."""


class WeightPushError(RuntimeError):
    """The server refused a weight push (it changed nothing); the message says why, for people.

    `serving_version`: the version of the pushed kind the replicas still serve, as the refusal reports it
    (None when the refusal came before the push's kind was known). At or above the pushed version, the
    rollout already has that push or a newer one: a caller re-sending it can stop (drafter coordinator)."""

    def __init__(self, message: str, serving_version: int | None = None) -> None:
        super().__init__(message)
        self.serving_version = serving_version


def make_prompt(p: str | Sequence[int], reference: str = "") -> rollout_pb2.Prompt:
    if isinstance(p, str):
        return rollout_pb2.Prompt(text=p, reference=reference)
    return rollout_pb2.Prompt(token_ids=rollout_pb2.TokenIds(ids=list(p)), reference=reference)


KEEPALIVE_S = (30.0, 30.0)  # ping a call's connection every 30 s; a server silent 30 s more ends the call


class RolloutClient:
    def __init__(self, address: str, control_token: str = "", timeout_s: float | None = None,
                 keepalive_s: tuple[float, float] | None = KEEPALIVE_S) -> None:
        """keepalive_s: (every, timeout) of the connection's pings while a call runs (`channels.keepalive_options`):
        a rollout server that hangs ends the calls waiting on it with UNAVAILABLE (a trainer's rollout has no
        deadline, and waited forever); None: no pings."""
        self.address = address
        options = _OPTIONS + (keepalive_options(*keepalive_s) if keepalive_s is not None else [])
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.control_token = resolve_token(control_token)  # else $TLT_AUTH_TOKEN / $TLT_AUTH_TOKEN_FILE
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def batch_generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        n: int = 1,
        params: rollout_pb2.SamplingParams | None = None,
        references: Sequence[str] | None = None,
        batch_id: str = "",
    ) -> Iterator[rollout_pb2.Completion]:
        """Stream one Completion per sequence as each finishes (len(prompts) * n in all)."""
        refs = [""] * len(prompts) if references is None else list(references)
        if len(refs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(refs)} references: give one per prompt")
        req = rollout_pb2.BatchGenerateRequest(
            batch_id=batch_id, n=n, params=params or rollout_pb2.SamplingParams(),
            prompts=[make_prompt(p, r) for p, r in zip(prompts, refs)])
        return iter(self.stub.BatchGenerate(req, timeout=self.timeout_s))

    def generate(self, prompt: str | Sequence[int], n: int = 1,
                 params: rollout_pb2.SamplingParams | None = None) -> list[rollout_pb2.Completion]:
        req = rollout_pb2.GenerateRequest(prompt=make_prompt(prompt), n=n, params=params or rollout_pb2.SamplingParams())
        return list(self.stub.Generate(req, timeout=self.timeout_s).completions)

    def status(self) -> rollout_pb2.RolloutStatus:
        """The server's status; `control_refused` says whether this client's token would pass the control plane."""
        return self.stub.GetStatus(rollout_pb2.StatusRequest(), metadata=self._control_metadata(), timeout=self.timeout_s)

    def check_control(self) -> None:
        """Raise ControlRefusedError now if the server would refuse this client's weight pushes (a missing or
        wrong token), instead of at the first push after a whole RL step."""
        why = self.status().control_refused
        if why:
            raise ControlRefusedError(
                f"rollout server {self.address} refuses this client's control-plane calls (weight pushes): {why}. "
                "Give the rollout server and this client the same token: TLT_AUTH_TOKEN, TLT_AUTH_TOKEN_FILE or "
                "the config's token field")

    def lend_devices(self, lend: bool, lease_s: float = 0.0, holder: str = "trainer") -> rollout_pb2.LendResponse:
        """Colocated placement: lend the replicas' devices to the trainer for `lease_s` (or renew), or take them
        back (`lend=False`); returns once the replicas have released (resumed)."""
        req = rollout_pb2.LendRequest(lend=lend, lease_s=lease_s, holder=holder)
        return self.stub.LendDevices(req, metadata=self._control_metadata(), timeout=self.timeout_s)

    def _control_metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", bearer(self.control_token)),) if self.control_token else None

    def push_chunks(self, chunks: Iterator[rollout_pb2.WeightChunk]) -> rollout_pb2.UpdateWeightsResponse:
        """Send an already-built chunk stream (tests use it to send corrupted pushes)."""
        return self.stub.UpdateWeights(chunks, metadata=self._control_metadata(), timeout=self.timeout_s)

    def update_weights(self, tensors: Mapping[str, Any], kind: str, version: int,
                       shm: bool = False) -> rollout_pb2.UpdateWeightsResponse:
        """Push a state dict (HF names); raises WeightPushError when the server refuses it."""
        from tlt.services.common.weights import iter_chunks, pack_state_dict, shm_payload

        manifest, payload = pack_state_dict(dict(tensors), _KINDS[kind], version)
        if shm:
            with shm_payload(manifest, payload) as shm_manifest:
                resp = self.push_chunks(iter_chunks(shm_manifest, None))
        else:
            resp = self.push_chunks(iter_chunks(manifest, payload))
        if not resp.ok:
            raise WeightPushError(resp.error, resp.version if resp.kind == _KINDS[kind] else None)
        return resp

    def get_weights(self, names: Sequence[str], kind: str = "policy") -> tuple[int, dict[str, Any]]:
        """The named tensors of the policy the replicas serve now and its version (0: the start checkpoint).

        Raises grpc.RpcError: UNAUTHENTICATED without the control token, NOT_FOUND for an unknown name."""
        from tlt.services.common.weights import assemble, unpack

        req = rollout_pb2.GetWeightsRequest(kind=_KINDS[kind], names=list(names))
        chunks = self.stub.GetWeights(req, metadata=self._control_metadata(), timeout=self.timeout_s)
        manifest, payload = assemble(chunks)
        return manifest.version, unpack(manifest, payload)
