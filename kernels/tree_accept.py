"""The speculative-decoding acceptance walk over a draft tree: Triton kernel, PyTorch reference, dispatch.

Inputs, per sequence b (N nodes, node 0 = the root = the last verified token):
    draft_tokens  [B, N] int64  token of each node (children of one node have distinct tokens)
    parents       [B, N] int64  parent node index; -1 for the root; parents[i] < i
    target_tokens [B, N] int64  the target's choice after each node: its argmax (greedy)
                                or ONE token drawn from the filtered target distribution q
                                at that node (sampling)

Walk: start at c = 0. If a child j of c has draft_tokens[j] == target_tokens[c],
accept j and continue from j; otherwise stop. The token emitted after the
accepted path is the bonus `target_tokens[c_last]`.

Why this one walk is lossless for both modes (TLT.md section 4): with greedy,
the emitted tokens are exactly the target's argmax chain. With sampling, the
token y = target_tokens[c] is a draw from q at c; accepting the child whose
token is y and emitting y when no child matches is exactly "sample y ~ q, then
see whether the draft guessed it", so every emitted token is distributed as q
(the draft only decides how many of those draws one verify pass can keep).

Outputs:
    accept_len [B] int64     accepted draft nodes, excluding the root
    path       [B, N] int64  accepted node indices in order, starting with 0, padded with -1
    bonus      [B] int64     target_tokens[last accepted node]

Padding: trees with fewer real nodes can pad with parents = -1 (never a child
of anything reachable) or any node whose token no target choice matches.
The kernel runs one program per sequence, the whole tree in one tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from tlt.kernels.launch import Impl, LazyKernel, check, next_pow2, use_triton

MAX_NODES = 1024


@dataclass(frozen=True)
class Acceptance:
    """Result of the acceptance walk for a batch of draft trees."""

    accept_len: torch.Tensor  # [B] int64
    path: torch.Tensor  # [B, N] int64, -1 padded
    bonus: torch.Tensor  # [B] int64


def tree_accept_ref(draft_tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor) -> Acceptance:
    """Reference walk: a plain loop per sequence."""
    batch, nodes = draft_tokens.shape
    drafts, pars, targets = draft_tokens.tolist(), parents.tolist(), target_tokens.tolist()
    path = torch.full((batch, nodes), -1, dtype=torch.int64)
    accept_len = torch.zeros(batch, dtype=torch.int64)
    bonus = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        walk = [0]
        while True:
            cur = walk[-1]
            wanted = targets[b][cur]
            nxt = next((j for j in range(1, nodes) if pars[b][j] == cur and drafts[b][j] == wanted), None)
            if nxt is None:
                break
            walk.append(nxt)
        path[b, : len(walk)] = torch.tensor(walk)
        accept_len[b] = len(walk) - 1
        bonus[b] = targets[b][walk[-1]]
    device = draft_tokens.device
    return Acceptance(accept_len.to(device), path.to(device), bonus.to(device))


def _tree_accept_kernel(
    draft_ptr, parent_ptr, target_ptr, accept_len_ptr, path_ptr, bonus_ptr,
    stride_draft, stride_parent, stride_target, stride_path,
    N, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    in_tree = offs < N
    draft = tl.load(draft_ptr + b * stride_draft + offs, mask=in_tree, other=-1).to(tl.int64)
    parent = tl.load(parent_ptr + b * stride_parent + offs, mask=in_tree, other=-1).to(tl.int64)
    target = tl.load(target_ptr + b * stride_target + offs, mask=in_tree, other=-1).to(tl.int64)
    candidate = in_tree & (offs > 0)
    none = tl.full([BLOCK], BLOCK, tl.int64)

    cur = tl.full([], 0, tl.int64)  # current node
    length = tl.full([], 0, tl.int64)  # accepted draft nodes so far
    done = tl.full([], 0, tl.int64)  # 1 once a level found no matching child
    path = tl.where(offs == 0, 0, -1).to(tl.int64)
    # Each accepted node is deeper than the last, so N - 1 levels bound the walk.
    for _ in range(1, N):
        wanted = tl.sum(tl.where(offs == cur, target, 0), axis=0)
        match = candidate & (parent == cur) & (draft == wanted)
        nxt = tl.min(tl.where(match, offs.to(tl.int64), none), axis=0)
        step = (done == 0) & (nxt < BLOCK)
        path = tl.where(step & (offs == length + 1), nxt, path)
        length = tl.where(step, length + 1, length)
        cur = tl.where(step, nxt, cur)
        done = tl.where(step, done, 1)

    tl.store(path_ptr + b * stride_path + offs, path, mask=in_tree)
    tl.store(accept_len_ptr + b, length)
    tl.store(bonus_ptr + b, tl.sum(tl.where(offs == cur, target, 0), axis=0))


tree_accept_kernel = LazyKernel(_tree_accept_kernel)


def tree_accept_triton(
    draft_tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor,
    out: Acceptance | None = None,
) -> Acceptance:
    """The acceptance walk with the Triton kernel; `out` buffers (optional) are written and returned."""
    check(draft_tokens.dim() == 2, f"draft_tokens must be [B, N], got {tuple(draft_tokens.shape)}")
    batch, nodes = draft_tokens.shape
    check(1 <= nodes <= MAX_NODES, f"N must be in 1..{MAX_NODES}, got {nodes}")
    for name, t in (("draft_tokens", draft_tokens), ("parents", parents), ("target_tokens", target_tokens)):
        check(t.shape == (batch, nodes) and t.dtype == torch.int64, f"{name} must be int64 [{batch}, {nodes}], got {t.dtype} {tuple(t.shape)}")
        check(t.stride(1) == 1, f"{name} needs a contiguous last dim")
        check(t.device == draft_tokens.device, f"{name} must be on {draft_tokens.device}")
    if out is None:
        device = draft_tokens.device
        out = Acceptance(
            accept_len=torch.empty(batch, dtype=torch.int64, device=device),
            path=torch.empty((batch, nodes), dtype=torch.int64, device=device),
            bonus=torch.empty(batch, dtype=torch.int64, device=device),
        )
    # the kernel writes accept_len[b] and bonus[b] at offset b: a strided view would be written past its elements
    check(out.accept_len.shape == (batch,) and out.accept_len.dtype == torch.int64 and out.accept_len.is_contiguous(),
          "out.accept_len must be contiguous int64 [B]")
    check(out.bonus.shape == (batch,) and out.bonus.dtype == torch.int64 and out.bonus.is_contiguous(),
          "out.bonus must be contiguous int64 [B]")
    check(out.path.shape == (batch, nodes) and out.path.dtype == torch.int64 and out.path.stride(1) == 1, "out.path must be int64 [B, N]")
    if batch > 0:
        tree_accept_kernel[(batch,)](
            draft_tokens, parents, target_tokens, out.accept_len, out.path, out.bonus,
            draft_tokens.stride(0), parents.stride(0), target_tokens.stride(0), out.path.stride(0),
            nodes, BLOCK=next_pow2(nodes),
        )
    return out


def tree_accept(
    draft_tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor, impl: Impl = "auto"
) -> Acceptance:
    """The acceptance walk: the Triton kernel on CUDA, the reference elsewhere (see `tlt.kernels.launch`)."""
    if use_triton(draft_tokens, impl):
        return tree_accept_triton(draft_tokens, parents, target_tokens)
    return tree_accept_ref(draft_tokens, parents, target_tokens)
