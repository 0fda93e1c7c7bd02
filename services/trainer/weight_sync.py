"""Push the policy's new weights to every rollout server after each update.

    Policy module -> policy_tensors (HF names, rollout dtype, tied lm_head dropped)
                  -> RolloutClient.update_weights (gRPC UpdateWeights: manifest + chunks,
                     or a /dev/shm file named in the manifest on the same host)
                  -> PushReport (bytes, seconds, server-side apply seconds, replicas)

The rollout server validates the whole update before applying it between two
engine steps; a refusal raises `WeightPushError` and the run stops (training
on while the rollout samples from stale weights would silently turn the run
off-policy). `check_versions` is the other half: the next rollout's
completions must all carry the version just pushed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tlt.services.common.logging import get_logger

log = get_logger("trainer.weight_sync")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StaleWeightsError(RuntimeError):
    """A rollout produced completions with an older policy version than the one pushed."""


@dataclass(frozen=True)
class PushReport:
    version: int
    bytes: int
    seconds: float  # trainer side: pack + send + wait for the servers' answer
    apply_seconds: float  # slowest server's own validate + apply time
    replicas: tuple[int, ...]


def policy_tensors(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module's weights as the rollout engine names them, cast to the engine's dtype, on CPU.

    A tied lm_head shares the embedding's storage and is not a tensor of its
    own in the checkpoint format, so it is left out.
    """
    tied = bool(getattr(getattr(module, "config", None), "tie_word_embeddings", False))
    out = {}
    for name, t in module.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
    return out


def resolve_dtype(name: str, trainer_bf16: bool) -> torch.dtype:
    """'auto' follows the rollout defaults: bf16 where the trainer runs bf16 (GPU), fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if trainer_bf16 else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"push dtype {name!r} unknown; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class WeightPublisher:
    """Pushes policy versions to a set of rollout servers (RolloutClient instances)."""

    def __init__(self, clients: Sequence, mode: str = "grpc") -> None:  # noqa: ANN001 - RolloutClient
        if mode not in ("grpc", "shm"):
            raise ValueError(f"weight push mode {mode!r} unknown; use grpc or shm")
        self.clients = list(clients)
        self.mode = mode
        if mode == "shm":  # files of an earlier trainer killed mid-push (SIGKILL, OOM) would stay in /dev/shm
            from tlt.services.common.weights import sweep_stale_shm

            for path in sweep_stale_shm():
                log.warning("stale_shm_removed", path=path)

    def push(self, tensors: dict[str, torch.Tensor], version: int) -> PushReport:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        t0 = time.perf_counter()
        apply_s = 0.0
        replicas: list[int] = []
        for client in self.clients:
            resp = client.update_weights(tensors, kind="policy", version=version, shm=self.mode == "shm")
            if resp.version != version:
                raise StaleWeightsError(f"rollout {client.address} answered version {resp.version}, pushed {version}")
            apply_s = max(apply_s, resp.apply_seconds)
            replicas += list(resp.replicas)
        report = PushReport(version, nbytes, time.perf_counter() - t0, apply_s, tuple(replicas))
        log.info("weights_pushed", version=version, mb=round(nbytes / 2**20, 2), seconds=round(report.seconds, 3),
                 apply_seconds=round(apply_s, 3), servers=len(self.clients))
        return report


def check_versions(versions: Iterable[int], expected: int) -> None:
    """Every completion of a rollout must come from the policy version last pushed."""
    stale = sorted({v for v in versions if v != expected})
    if stale:
        raise StaleWeightsError(
            f"completions carry policy version(s) {stale} but version {expected} was pushed before the rollout; "
            "the rollout server did not apply the update"
        )
