"""Push the policy's new weights to every rollout server after each update.

    Policy module -> policy_tensors (HF names, rollout dtype, tied lm_head dropped; ZeRO-3: gathered,
                                     a collective of every rank, rank 0 sends)
                  -> RolloutClient.update_weights (gRPC UpdateWeights: manifest + chunks,
                     or a /dev/shm file named in the manifest on the same host)
                  -> PushReport (bytes, seconds, server-side apply seconds, replicas)

The rollout server validates the whole update before applying it between two
engine steps; a refusal raises `WeightPushError` and the run stops (training
on while the rollout samples from stale weights would silently turn the run
off-policy). `check_versions` is the other half: the next rollout's
completions must all carry the version just pushed. `VersionGuard` applies it
to a rollout and heals the one case that needs no human: a rollout server
restarted since the push (it serves its start checkpoint, an older version)
gets the weights again and the batch is rolled out again, once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tlt.services.common.logging import get_logger

if TYPE_CHECKING:
    from tlt.services.trainer.collect import RolloutResult

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


def partitioned(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the module's parameters (each rank holds a slice of each)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def full_state_dict(module: torch.nn.Module, dtype: torch.dtype | None = None, skip: tuple[str, ...] = (),
                    keep: bool | None = None) -> dict[str, torch.Tensor]:
    """module.state_dict() whole, on CPU, floating tensors cast to `dtype` (None: as they are), less `skip`.

    Under ZeRO-3 the module's parameters are empty outside a forward: each is gathered
    (an all-gather over the ranks, one parameter at a time, so the device never holds more
    than one whole tensor beyond its partitions), copied to the host, and partitioned again.
    That is a collective: every rank must call this, with the same arguments, even where
    only rank 0 uses the result; `keep` (default: rank 0 only under ZeRO-3) says whether
    this rank copies the tensors out, others return {}. Tied parameters are gathered once
    and stay one tensor under both names.
    """
    import torch.distributed as dist

    zero3 = partitioned(module)
    if keep is None:
        keep = not zero3 or not dist.is_initialized() or dist.get_rank() == 0

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype).contiguous()

    out: dict[str, torch.Tensor] = {}
    # On every rank, keeping or not: a rank that gathered a tied parameter twice ran an all-gather the others skip.
    done: dict[int, torch.Tensor | None] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if name in skip:
            continue
        if id(t) in done:
            if keep:
                out[name] = done[id(t)]
            continue
        if zero3 and hasattr(t, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([t], modifier_rank=None):
                value = host(t) if keep else None
        else:
            value = host(t) if keep else None
        done[id(t)] = value
        if keep:
            out[name] = value
    return out


def policy_tensors(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The module's weights as the rollout engine names them, cast to the engine's dtype, on CPU.

    A tied lm_head shares the embedding's storage and is not a tensor of its
    own in the checkpoint format, so it is left out. Under ZeRO-3 this is a
    collective (`full_state_dict`): every rank calls it, rank 0 gets the
    tensors and the other ranks {}.
    """
    tied = bool(getattr(getattr(module, "config", None), "tie_word_embeddings", False))
    return full_state_dict(module, dtype, skip=("lm_head.weight",) if tied else ())


def resolve_dtype(name: str, trainer_bf16: bool) -> torch.dtype:
    """'auto' follows the rollout defaults: bf16 where the trainer runs bf16 (GPU), fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if trainer_bf16 else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"push dtype {name!r} unknown; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class PushDtypeError(ValueError):
    """The trainer would push weights in a dtype the rollout server refuses (found before the first step)."""


def check_push_dtype(cfg, bf16: bool, clients: Sequence) -> None:  # noqa: ANN001 - TrainerConfig
    """Raise PushDtypeError when a rollout server would refuse every weight push for its dtype: the pushed one
    (push_dtype; "auto" follows the trainer's bf16, which on a GPU is on unless [trainer] bf16 says otherwise) must
    be the one its status names. The config check cannot know the device; without this, the first push after a
    whole rollout and training step was refused tensor by tensor. A server that names none (older) is not checked."""
    pushed = str(resolve_dtype(cfg.push_dtype, bf16)).removeprefix("torch.")
    for client in clients:
        status = client.status()
        served = status.dtype
        if not served or served == pushed:
            continue
        if cfg.push_dtype != "auto":
            why = ""
        elif cfg.bf16 is None:
            why = f" (bf16 unset: the trainer {'trains bf16 on its GPU' if bf16 else 'trains fp32 on CPU'})"
        else:
            why = f" (bf16 = {str(cfg.bf16).lower()})"
        # the native engine takes pushes in its own dtype; SGLang's pool in its checkpoint's, whatever it computes in
        other = (" (the SGLang backend takes pushes in its checkpoint's dtype)" if status.backend == "sglang"
                 else f' or rollout.engine.dtype = "{pushed}"')
        raise PushDtypeError(
            f'[trainer] push_dtype="{cfg.push_dtype}" pushes {pushed} weights{why} but rollout server {client.address} '
            f'serves {served}: it would refuse every weight push; set trainer.push_dtype = "{served}" (the trainer '
            f'casts each push){other}')


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

    def push(self, tensors: dict[str, torch.Tensor], version: int, clients: Sequence | None = None) -> PushReport:
        """To every server, or to `clients` (a restarted one's second push, VersionGuard)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        t0 = time.perf_counter()
        apply_s = 0.0
        replicas: list[int] = []
        targets = self.clients if clients is None else list(clients)
        for client in targets:
            resp = client.update_weights(tensors, kind="policy", version=version, shm=self.mode == "shm")
            if resp.version != version:
                raise StaleWeightsError(f"rollout {client.address} answered version {resp.version}, pushed {version}")
            apply_s = max(apply_s, resp.apply_seconds)
            replicas += list(resp.replicas)
        report = PushReport(version, nbytes, time.perf_counter() - t0, apply_s, tuple(replicas))
        log.info("weights_pushed", version=version, mb=round(nbytes / 2**20, 2), seconds=round(report.seconds, 3),
                 apply_seconds=round(apply_s, 3), servers=len(targets))
        return report


def check_versions(versions: Iterable[int], expected: int) -> None:
    """Every completion of a rollout must come from the policy version last pushed."""
    stale = sorted({v for v in versions if v != expected})
    if stale:
        raise StaleWeightsError(
            f"completions carry policy version(s) {stale} but version {expected} was pushed before the rollout; "
            "the rollout server did not apply the update"
        )


class VersionGuard:
    """`collect(roll_out, version)`: the rollout `roll_out()` returns (a collect.RolloutResult), checked to carry
    `version` in every completion (collect() checks each as it arrives: a stale one fails the rollout before any of
    it is scored, its streams and reward calls cancelled). When some do not and a server now serves an older version
    than `version` (it restarted from its start checkpoint after the push), `repush(behind, version)` gives those
    servers the weights again and the batch is rolled out again, once; its seeds are the batch's own, so it draws
    what it would have where the rollout's sampling is reproducible (`[trainer] reproducible_rollouts` under
    speculation).
    The result kept counts the dropped rollout (and the attempts it had redone itself) in its retries, and the
    time until the second began, the push included, in its rollout_s and rollout_retry_s.
    StaleWeightsError otherwise: no `repush`, a server serving a newer version (another trainer pushes to it), or a
    rollout still stale after the second push. (Under ZeRO-3 with several ranks the trainer's `repush` calls the
    other ranks into the gather: loop.GATHER.)"""

    def __init__(self, clients: Sequence, repush: Callable[[list, int], object] | None = None) -> None:
        self.clients, self.repush = list(clients), repush
        self.repushes = 0  # servers given the weights again, in all

    def collect(self, roll_out: Callable[[], RolloutResult], version: int) -> RolloutResult:
        from tlt.services.trainer.collect import EXPECTED_VERSION

        t0 = time.perf_counter()
        token = EXPECTED_VERSION.set(version)  # collect() fails at a stale completion, before it is scored
        try:
            first = None
            try:
                first = roll_out()
                check_versions((s.policy_version for s in first.samples), version)
                return first
            except StaleWeightsError as e:  # the dropped rollout's own redos (collect_retrying's), returned or failed
                redos = first.retries if first is not None else getattr(e, "retries", 0)
                behind = self._behind(version)
                if self.repush is None or not behind:
                    raise
            log.warning("rollout_restarted", servers=[c.address for c in behind], version=version,
                        action="pushing the weights to them again and rolling the batch out again")
            self.repush(behind, version)
            self.repushes += len(behind)
            t_again = time.perf_counter()
            result = roll_out()
            check_versions((s.policy_version for s in result.samples), version)
            return result.redone(redos + 1, t_again - t0)  # the first attempt dropped, and its own redos
        finally:
            EXPECTED_VERSION.reset(token)

    def _behind(self, version: int) -> list:
        """The servers serving an older version than `version` now; none when any cannot say (down again) or one
        serves a newer one (not a restart: another trainer's push, which a second push of ours would not fix)."""
        import grpc

        try:
            serving = [(c, c.status().versions.policy) for c in self.clients]
        except grpc.RpcError:
            return []
        if any(v > version for _, v in serving):
            return []
        return [c for c, v in serving if v < version]
