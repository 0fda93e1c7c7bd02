"""The target's embedding and lm_head as the drafter service sees them, kept at the policy's version.

    --model at start (policy version 0) --> SharedTensors
    capacity events / feature batches carry the policy version --see(v)--> newer than ours?
        --refresh() (between two windows or evaluations, never inside a micro-step)-->
        gRPC tlt.v1.Rollout/GetWeights(embed, lm_head) --> SharedTensors(version v')

The drafter uses the target's own embedding (input) and lm_head (the CE term of the loss, the offline
acceptance gate) by reference (TLT.md section 3). In the rollout engine they are the engine model's;
the drafter service runs in other processes, so it fetches the current ones from the rollout when it
sees a newer policy version, and until then (or when the fetch fails: logged, counted, retried after
`retry_s`) keeps training and gating with the ones it has. A tied model has no lm_head of its own: the
embedding is both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tlt.services.common.logging import get_logger

log = get_logger("drafter.shared")

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class SharedTensors:
    """The target's embedding and lm_head (fp32, CPU) and the policy version they belong to."""

    policy_version: int
    embed: torch.Tensor
    lm_head: torch.Tensor


Fetch = Callable[[], SharedTensors]  # the policy's current ones; raises when it cannot get them


def shared_names(tied: bool) -> list[str]:
    return [EMBED] if tied else [EMBED, LM_HEAD]


def rollout_fetch(model_dir: str, address: str, token: str, timeout_s: float = 300.0) -> Fetch:
    """A `Fetch` of the target in `model_dir` from the rollout at `address` (gRPC GetWeights, a control-plane
    call: `token`, else $TLT_AUTH_TOKEN)."""
    from tlt.model.folder import read_model_config

    tied = read_model_config(model_dir).tie_word_embeddings

    def fetch() -> SharedTensors:
        import grpc

        from tlt.services.rollout.client import RolloutClient

        with RolloutClient(address, control_token=token, timeout_s=timeout_s) as client:
            try:
                version, tensors = client.get_weights(shared_names(tied))
            except grpc.RpcError as e:
                raise RuntimeError(f"GetWeights from {address}: {e.code().name}: {e.details()}") from None  # type: ignore[attr-defined]
        embed = tensors[EMBED].float()
        return SharedTensors(version, embed, embed if tied else tensors[LM_HEAD].float())

    return fetch


class SharedWeights:
    """The tensors in use (`current`), the newest policy version seen, and fetch failures.

    `see` may be called from any thread; `refresh` from the one thread that uses the tensors."""

    def __init__(self, initial: SharedTensors, fetch: Fetch | None, retry_s: float = 5.0) -> None:
        self.current = initial
        self.fetch = fetch
        self.retry_s = retry_s
        self.seen = initial.policy_version  # the newest policy version heard of
        self.failures = 0
        self.last_error = ""
        self._asked = initial.policy_version  # the newest version a fetch succeeded for
        self._next_try = 0.0
        self._lock = threading.Lock()

    def see(self, policy_version: int) -> None:
        with self._lock:
            self.seen = max(self.seen, int(policy_version))

    def stale(self) -> bool:
        return self.fetch is not None and self.seen > self._asked

    def refresh(self) -> bool:
        """Fetch the policy's tensors when a newer version was seen; True when `current` changed."""
        if not self.stale() or time.monotonic() < self._next_try:
            return False
        want = self.seen
        try:
            got = self._fetch_checked()
        except Exception as e:  # deliberate boundary: keep the tensors we have, report, retry later
            self.failures += 1
            self.last_error = repr(e)[:500]
            self._next_try = time.monotonic() + self.retry_s
            log.warning("shared_fetch_failed", want=want, using=self.current.policy_version, failures=self.failures,
                        error=self.last_error)
            return False
        self._asked = got.policy_version
        if got.policy_version < want:  # a rollout still applying the push (features of a replica that applied it came
            # first, a push that failed on a replica and is sent again, a restarted server): asked again in retry_s.
            # Taken as fetched, it was never asked again, and the drafter trained on the previous policy's tensors
            # until a later version was seen.
            self._next_try = time.monotonic() + self.retry_s
        if got.policy_version <= self.current.policy_version:
            return False
        previous, self.current = self.current.policy_version, got
        log.info("shared_refreshed", policy_version=got.policy_version, previous=previous)
        return True

    def _fetch_checked(self) -> SharedTensors:
        got = self.fetch()  # type: ignore[misc]
        old = self.current
        if got.embed.shape != old.embed.shape or got.lm_head.shape != old.lm_head.shape:
            raise ValueError(f"policy v{got.policy_version} embed/lm_head shapes {tuple(got.embed.shape)}, "
                             f"{tuple(got.lm_head.shape)} differ from the drafter's {tuple(old.embed.shape)}, "
                             f"{tuple(old.lm_head.shape)}: is rollout_grpc the rollout of this --model?")
        return got
