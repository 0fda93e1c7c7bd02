"""Draft trees: the arm that shapes them, EAGLE-2 style construction, and the tree attention mask.

An arm `steps_topk_drafttokens` (e.g. "8_4_48") drafts `steps` levels. Level 1
holds the root's `topk` best children; every later level expands each of the
`topk` best nodes of the previous level (by cumulative draft log-probability)
into its `topk` best children. From all the candidates, the `draft_tokens - 1`
with the highest cumulative log-probability are kept, plus the root, and sent
to the target for verification. Because a child's cumulative log-probability
never exceeds its parent's, and ties are broken towards the shallower (earlier)
candidate, the kept set is always a connected tree containing the root.
topk = 1 is a chain of `steps` drafts (draft_tokens = steps + 1). The arm "plain" (steps 0) drafts
nothing: the step decodes plainly, so that an adaptive bandit can choose not to speculate where
drafting does not pay (a stale drafter, a compute-bound batch) and measure that choice like any other.

Node 0 is the root: the last verified token, which the target has not consumed
yet. Nodes are ordered so that every parent precedes its children. A batch of
trees shares N = draft_tokens (the kernel `tlt.kernels.tree_accept` and the
acceptance reference take tokens/parents as [B, N]).
"""

from __future__ import annotations

import math

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tlt.services.rollout.spec.arm import Arm  # its home: arm.py (no torch); imported from here too


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees with the same node count N.

    tokens [B, N] (node 0 = root), parents [B, N] (-1 for the root), depth [B, N]
    (root 0). `score` [B, N] is the cumulative draft log-probability (0 at the root).
    `draft_probs` [B, N - 1, V], only for chains SAMPLED from the drafter: the distribution p that
    node i + 1's token was drawn from (verified by rejection sampling, `chain_accept_rejection`);
    None for deterministic drafts (verified by the tree walk). `sampled` [B] bool (CPU): which rows'
    drafts were sampled (their draft_probs rows are p); the others are verified by the tree walk. With the
    confidence cut (`chain_min_prob`) a sampled row's kept drafts carry r, the distribution the cut offered
    them from (`accept.cut_sampled_chain`), not p.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    draft_probs: torch.Tensor | None = None
    sampled: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])

    def positions(self, root_positions: torch.Tensor) -> torch.Tensor:
        """Sequence positions of the nodes: the root sits at `root_positions` [B], a node at root + depth."""
        return root_positions.to(self.depth.device).long()[:, None] + self.depth

    def attention_mask(self) -> torch.Tensor:
        """[B, N, N] bool: node i may attend to node j iff j is i itself or one of its ancestors."""
        return ancestor_mask(self.parents)

    def children(self, b: int) -> list[list[int]]:
        """Child lists of tree b (for tests and debugging)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents[b].tolist()):
            if p >= 0:
                kids[p].append(i)
        return kids


def is_chain(parents: torch.Tensor) -> bool:
    """Whether every tree of the batch [B, N] is a chain: node i's parent is i - 1 (a root alone is one)."""
    n = parents.shape[1]
    return n == 1 or bool((parents[:, 1:] == torch.arange(n - 1, device=parents.device)).all())


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] parents (each parent index < its child's) -> [B, N, N] ancestor-or-self mask."""
    b, n = parents.shape
    dev = parents.device
    idx = torch.arange(n, device=dev)
    if is_chain(parents):  # node i sees nodes 0..i
        return torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(b, n, n).clone()
    mask = torch.eye(n, dtype=torch.bool, device=dev).expand(b, n, n).clone()
    rows = torch.arange(b, device=dev)[:, None].expand(b, n)
    cols = idx.expand(b, n)
    anc = parents.clone()  # walk every node's ancestors one level per pass: at most depth passes
    while True:
        has = anc >= 0
        if not bool(has.any()):
            return mask
        mask[rows[has], cols[has], anc[has]] = True
        anc = torch.where(has, parents.gather(1, anc.clamp(min=0)), anc)


def chain_tree(root_tokens: torch.Tensor, drafts: torch.Tensor, score: torch.Tensor | None = None,
               draft_probs: torch.Tensor | None = None) -> DraftTree:
    """A chain: root [B] followed by drafts [B, S]; node i's parent is i - 1 (draft_probs: see DraftTree)."""
    b, s = drafts.shape
    tokens = torch.cat([root_tokens.view(b, 1).long(), drafts.long()], dim=1)
    idx = torch.arange(s + 1, device=drafts.device)
    parents = (idx - 1).expand(b, s + 1).clone()
    depth = idx.expand(b, s + 1).clone()
    if score is None:
        score = torch.zeros(b, s + 1, device=drafts.device)
    return DraftTree(tokens, parents, depth, score, draft_probs)


# expand(step, beam_nodes [B, K], beam_tokens [B, K]) -> draft log-probs [B, K, V] for each beam node's child.
# Candidate numbering (what beam_nodes index): root = 0, then candidates in the order they are drafted:
# step 0 adds topk nodes 1..topk, step s adds K * topk nodes (beam node-major, child rank minor).
ExpandFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def build_tree(root_tokens: torch.Tensor, expand: ExpandFn, arm: Arm) -> DraftTree:
    """EAGLE-2 tree drafting for a batch: grow `arm.steps` levels, keep the best `arm.draft_tokens` nodes."""
    arm.validate()
    b = root_tokens.shape[0]
    dev = root_tokens.device
    tokens = [root_tokens.view(b, 1).long()]
    parents = [torch.full((b, 1), -1, dtype=torch.long, device=dev)]
    depth = [torch.zeros(b, 1, dtype=torch.long, device=dev)]
    scores = [torch.zeros(b, 1, device=dev)]
    beam = torch.zeros(b, 1, dtype=torch.long, device=dev)
    beam_score = torch.zeros(b, 1, device=dev)
    beam_tokens = tokens[0]
    n_cand = 1
    for step in range(arm.steps):
        logp = expand(step, beam, beam_tokens).float()  # [B, K, V]
        k = beam.shape[1]
        top_lp, top_tok = logp.topk(arm.topk, dim=-1)  # [B, K, topk], distinct tokens per node
        # A drafter whose activations overflow (weights that pass every check can) gives NaN, which topk ranks first:
        # such a draft scores worst, not above every real one; and no log-prob above 0, so a child never outscores
        # its parent and every kept node's parent is kept. Verification decides acceptance: this only shapes the
        # proposal. On the topk values, not the [B, K, V] log-probs (a pass over the vocabulary per level).
        top_lp = torch.nan_to_num(top_lp, nan=-math.inf, posinf=0.0).clamp_(max=0.0)
        cum = (beam_score[:, :, None] + top_lp).reshape(b, k * arm.topk)
        new_ids = n_cand + torch.arange(k * arm.topk, device=dev).expand(b, -1)
        tokens.append(top_tok.reshape(b, -1))
        parents.append(beam[:, :, None].expand(b, k, arm.topk).reshape(b, -1))
        depth.append(torch.full((b, k * arm.topk), step + 1, dtype=torch.long, device=dev))
        scores.append(cum)
        n_cand += k * arm.topk
        # Next beam: the topk best new candidates (stable: earlier candidate wins a tie).
        order = _stable_desc(cum)[:, : arm.topk]
        beam = new_ids.gather(1, order)
        beam_score = cum.gather(1, order)
        beam_tokens = tokens[-1].gather(1, order)
    all_tok = torch.cat(tokens, 1)
    all_par = torch.cat(parents, 1)
    all_dep = torch.cat(depth, 1)
    all_sc = torch.cat(scores, 1)
    keep = min(arm.draft_tokens, n_cand)
    # Best keep-1 non-root candidates by score; ties go to the earlier (shallower) candidate, so a
    # kept node's parent (score >= child's, earlier index) is always kept too.
    chosen = _stable_desc(all_sc[:, 1:])[:, : keep - 1] + 1
    chosen, _ = chosen.sort(dim=1)  # candidate order: parents before children
    chosen = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), chosen], 1)
    # Remap parents from candidate ids to positions in the kept list.
    remap = torch.full((b, n_cand), -1, dtype=torch.long, device=dev)
    remap.scatter_(1, chosen, torch.arange(keep, device=dev).expand(b, -1))
    par = all_par.gather(1, chosen)
    new_par = torch.where(par >= 0, remap.gather(1, par.clamp(min=0)), par)
    if (new_par[:, 1:] < 0).any():
        raise AssertionError("tree selection dropped a parent; candidate scores must not increase with depth")
    return DraftTree(all_tok.gather(1, chosen), new_par, all_dep.gather(1, chosen), all_sc.gather(1, chosen))


def _stable_desc(x: torch.Tensor) -> torch.Tensor:
    return torch.sort(x, dim=1, descending=True, stable=True).indices
