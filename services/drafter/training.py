"""Drafter training pieces shared by the online workers, warm-up and the benchmark.

    target checkpoint --target_shared--> (embed, lm_head) of the policy, frozen, shared by reference
                      (the online service keeps them at the policy's version: shared.py)
    PackedBatch --packed_pairs--> drafter forward (segment-masked) --drafter_loss--> AdamW step

Optimiser: AdamW with betas (0.9, 0.95), gradient norm clipped (TLT.md section 3); optional
uniform noise U(-noise, noise) on the input features (offline warm-up). `save_atomic` writes a
checkpoint to a temporary file in the same folder and renames it over the old one, so a `kill -9` at
any moment leaves either the old or the new state, never a torn file (`fsync=True`, for power loss,
also fsyncs the file before and its folder after the rename).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from safetensors import safe_open

from tlt.model.drafter import Drafter, DrafterConfig, load_drafter
from tlt.model.folder import read_model_config, weight_files
from tlt.services.common.seeds import torch_seed
from tlt.services.drafter.loss import DrafterLoss, drafter_loss
from tlt.services.drafter.packing import PackedBatch, PackedPairs, packed_pairs


def target_shared(model_dir: str | Path, device: str = "cpu") -> tuple[DrafterConfig, torch.Tensor, torch.Tensor]:
    """The drafter config for a target, and the target's embedding and lm_head (fp32), read from its folder."""
    cfg = read_model_config(model_dir)
    want = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for path in weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in want:
                    want[name] = f.get_tensor(name)
    embed = want["model.embed_tokens.weight"]
    if embed is None:
        raise ValueError(f"{model_dir} has no model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else want["lm_head.weight"]
    if head is None:  # untied without a head: the engine and transformers would not run the embedding as one either
        raise ValueError(f"{model_dir} has no lm_head.weight, and its config.json unties the head "
                         "(tie_word_embeddings=false): the drafter would train against a head the target does not "
                         "have; add the head, or set tie_word_embeddings to true if the embedding is the head")
    return DrafterConfig.from_model_config(cfg), embed.float().to(device), head.float().to(device)


def new_drafter(model_dir: str | Path, init: str = "", seed: int = 0, device: str = "cpu") -> Drafter:
    """A drafter for the target in `model_dir`: loaded from `init` when given, else seeded random."""
    return build_drafter(*target_shared(model_dir, device), init, seed, device)


def build_drafter(cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor, init: str = "", seed: int = 0,
                  device: str = "cpu") -> Drafter:
    """A drafter sharing `embed` / `head`: loaded from `init` when given, else seeded random."""
    if init:
        return load_drafter(init, embed, head).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(seed))
        return Drafter(cfg, embed, head).to(device)


def make_optimizer(drafter: Drafter, lr: float, weight_decay: float = 0.0) -> torch.optim.AdamW:
    return torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


def warm_up_optimizer() -> None:
    """Pay torch's once-a-process optimizer set-up now: the first optimizer a process builds (or the first
    `state_dict`, `load_state_dict` or `step`) imports torch._dynamo, ~900 modules and 1.1-1.4 s of CPU on a 2-core
    VM, tens of seconds of wall time at nice 19 beside busy replicas. A worker calls this before it watches its
    replica: in its first window the import came after the drafter was on the device and before the window first
    read the capacity events, so a BUSY meanwhile waited for it (release_ms=8601.9, steps=0 in an audit)."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], betas=(0.9, 0.95))
    p.grad = torch.zeros(1)
    opt.step()
    opt.load_state_dict(opt.state_dict())


def unrolled_targets(p: PackedPairs, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and loss mask of unroll step `step` (0 = the plain pairs): at index j, h_{j+step+1}, a
    target only where pair j + step is one (inside one segment, a response token) and lies in pair
    j's segment (a chain never drafts across sequences)."""
    if step == 0:
        return p.target, p.mask
    t = p.mask.shape[1]
    target = F.pad(p.target[:, step:], (0, 0, 0, step))
    same = F.pad(p.segment_ids[:, step:] == p.segment_ids[:, : t - step], (0, step), value=False)
    return target, F.pad(p.mask[:, step:], (0, step), value=False) & same


def micro_step(drafter: Drafter, opt: torch.optim.Optimizer, batch: PackedBatch, grad_clip: float = 1.0,
               noise: float = 0.0, generator: torch.Generator | None = None, ttt_steps: int = 1,
               ttt_decay: float = 0.8, should_stop: Callable[[], bool] | None = None) -> DrafterLoss | None:
    """One optimiser step on one packed batch; returns the loss record (of the plain pairs).

    ttt_steps > 1: training-time test (`Drafter.forward_unrolled`): the loss is the sum over unroll
    steps s of ttt_decay**s times that step's loss, so the drafter also learns to continue from its
    own predicted features, as chain and tree drafting make it do at every depth past the first.

    should_stop: asked at checkpoints through the step: in the forward pass after the drafter's fc and its
    attention, after its output (before the loss's lm_head products) and once the loss is computed, and in the
    backward pass as the gradient reaches the drafter's output, its attention output and its fc output (7 asks;
    with ttt_steps = k the forward and backward ones come once per unroll step: 5k + 2). True abandons the step
    before the update, returning None with the drafter and optimizer as they were (the gradients are cleared). A
    worker asks whether its replica turned busy: a preemption then runs at most the part of a step between two
    checkpoints on a device the rollout wants back (on the tiny model's drafter, 4 x 128 tokens: ~1-5 ms, where
    the rest of a step was up to ~20 ms, the backward pass ~60% of it; on a large vocabulary the loss's backward
    through the lm_head is one stretch). Each check should be cheap (a worker's reads the queued events), and may
    run on autograd's device thread (CUDA), while the caller's thread waits in backward()."""
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
    if should_stop is None:
        return _micro_step(drafter, opt, batch, grad_clip, noise, generator, ttt_steps, ttt_decay)

    def check(*_: object) -> None:
        if should_stop():
            raise _Stopped

    def watch(_module: nn.Module, _inputs: object, out: torch.Tensor) -> None:  # now, and when backward gets here
        check()
        if out.requires_grad:
            out.register_hook(check)

    hooks = [drafter.fc.register_forward_hook(watch), drafter.layer.self_attn.o_proj.register_forward_hook(watch)]
    try:
        return _micro_step(drafter, opt, batch, grad_clip, noise, generator, ttt_steps, ttt_decay, check)
    except _Stopped:
        opt.zero_grad(set_to_none=True)  # a backward pass stopped half way left some gradients
        return None
    finally:
        for h in hooks:
            h.remove()


class _Stopped(Exception):
    """micro_step's should_stop said so at a checkpoint."""


def _micro_step(drafter: Drafter, opt: torch.optim.Optimizer, batch: PackedBatch, grad_clip: float, noise: float,
                generator: torch.Generator | None, ttt_steps: int, ttt_decay: float,
                check: Callable[..., None] | None = None) -> DrafterLoss:
    """`micro_step`'s work; `check` (raises to stop) is called after the drafter's forward, once the loss is computed,
    and again as the backward pass reaches each prediction."""
    device = next(drafter.parameters()).device
    p = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask)
    feats = p.features.to(device, torch.float32)
    if noise > 0:
        u = torch.rand(feats.shape, generator=generator, device="cpu").to(device)
        feats = feats + (2 * u - 1) * noise
    drafter.train()
    ids, pos, seg = p.input_ids.to(device), p.positions.to(device), p.segment_ids.to(device)
    if ttt_steps == 1:
        preds = [drafter(ids, feats, pos, segment_ids=seg)]
    else:
        preds = drafter.forward_unrolled(ids, feats, pos, seg, ttt_steps)
    if check is not None:
        check()
    res = loss = None
    for s, pred in enumerate(preds):
        target, mask = unrolled_targets(p, s)
        r = drafter_loss(pred, target.to(device, torch.float32), drafter.lm_head, mask.to(device))
        res = r if res is None else res
        loss = r.loss if loss is None else loss + ttt_decay**s * r.loss
    if check is not None:
        check()
        for pred in preds:
            pred.register_hook(check)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip)
    opt.step()
    # the plain pairs' figures; loss is what was optimised, detached: its graph holds every parameter and
    # gradient, so a caller keeping the record kept the drafter alive on the device after "releasing" it
    return replace(res, loss=loss.detach())


def save_atomic(path: str | Path, obj: Any, fsync: bool = False) -> None:
    """torch.save to a temporary sibling, rename over `path` (atomic on POSIX).

    The rename alone survives the process being killed at any point (the page cache outlives it);
    `fsync=True` also survives a power loss, at the price of a disk flush (slow on busy disks).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_writers_files(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:  # the rename is durable only once the folder's entry is on disk (else the old file comes back)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_dead_writers_files(path: Path) -> None:
    """Delete the temporary files of writers of `path` that were killed mid-save (`.name.<pid>.tmp` of a pid that
    no longer runs): each is a whole checkpoint (a drafter's weights and optimizer state), and a worker killed
    repeatedly during saves would otherwise fill the disk with them. A live pid's file is left alone."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's process
            continue


def load_state(path: str | Path) -> Any | None:
    path = Path(path)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def own_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The drafter's own weights (fc.*, layer.*), detached fp32 CPU copies; asserts no shared tensor leaks in."""
    out = {k: v.detach().float().cpu().clone() for k, v in drafter.state_dict().items()}
    leaked = [k for k in out if "embed" in k or "lm_head" in k]
    assert not leaked, f"drafter state must never carry the target's embedding/lm_head: {leaked}"
    return out


def tensors_message(tensors: dict[str, torch.Tensor], version: int) -> tuple[bytes, bytes]:
    """A drafter's tensors as a (manifest, payload) pair of the coordinator-worker messages."""
    from tlt.services.common.weights import pack_state_dict
    from tlt.v1 import common_pb2

    manifest, payload = pack_state_dict(tensors, common_pb2.WEIGHT_KIND_DRAFTER, version)
    return manifest.SerializeToString(), bytes(payload)


def tensors_from(manifest: bytes, payload: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a (manifest, payload) pair of `tensors_message` (checked against the manifest's sha256)."""
    from tlt.services.common.weights import unpack
    from tlt.v1 import rollout_pb2

    return unpack(rollout_pb2.WeightManifest.FromString(manifest), payload, None)
