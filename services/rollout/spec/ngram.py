"""Model-free drafter: propose continuations by matching the context's suffix against text already seen.

RL samples every prompt n times (a GRPO group), and sibling samples share long stretches (the
problem restated, the same derivation steps), as does a long response with itself. So before the
learned drafter is any good, suffix matching over the request's own tokens and its siblings' gives
useful drafts for free.

    NgramIndex (one per group):  n-gram (min_n..max_n) -> positions where it ended, per sibling;
                                 updated as siblings emit tokens (`extend`).
    propose(sibling, arm)     :  for n = max_n .. min_n, take occurrences of the context's last n tokens
                                 (most recent first, own sequence before siblings), read the tokens that
                                 followed each, and merge up to `arm.topk` distinct continuations of up to
                                 `arm.steps` tokens into a trie: a chain, or a small tree.

The result is a `DraftTree` (B = 1, node 0 = the context's last token) with at most
`arm.draft_tokens` nodes; `pad_trees` batches trees of different sizes for acceptance (`pad_nodes`
the same from plain lists, as the engine drafts a batch).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from itertools import islice

import torch

from tlt.services.rollout.spec.tree import Arm, DraftTree


class NgramIndex:
    """Token sequences of one group (sibling id -> tokens) and where each n-gram ended in them."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.seqs: dict[int, list[int]] = {}
        # n-gram -> (sibling, end) in the order they were seen (all siblings), and the same per sibling:
        # a lookup reads the newest `scan` of each kind without walking every occurrence in the group
        self._where: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        self._own: dict[tuple[tuple[int, ...], int], list[int]] = defaultdict(list)

    def extend(self, sibling: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sibling's sequence (the prompt first, then emitted tokens)."""
        seq = self.seqs.setdefault(sibling, [])
        for tok in tokens:
            seq.append(int(tok))
            end = len(seq) - 1
            for n in range(self.min_n, min(self.max_n, len(seq)) + 1):
                gram = tuple(seq[end - n + 1 :])
                self._where[gram].append((sibling, end))
                self._own[(gram, sibling)].append(end)

    def _hits(self, gram: tuple[int, ...], sibling: int, scan: int) -> list[tuple[int, int]]:
        """The newest `scan` occurrences in the sibling's own text (newest first), then the newest `scan`
        in its siblings'. The walk over the group's list stops after `scan` foreign hits; it passes over
        at most the sibling's own hits among them."""
        own = [(sibling, end) for end in islice(reversed(self._own.get((gram, sibling), ())), scan)]
        others = list(islice((h for h in reversed(self._where.get(gram, ())) if h[0] != sibling), scan))
        return own + others

    def continuations(self, sibling: int, length: int, limit: int, scan: int = 64) -> list[list[int]]:
        """Up to `limit` continuations (each <= length tokens) of the sibling's current suffix, with
        distinct first tokens. Longer suffix matches rank first; within one suffix length, the sibling's
        own text before its siblings', recent before old, and for a first token already found a longer
        continuation replaces a shorter one (a match just before the end has only a short tail)."""
        ctx = self.seqs.get(sibling, [])
        best: dict[int, list[int]] = {}
        for n in range(min(self.max_n, len(ctx)), self.min_n - 1, -1):
            level: dict[int, list[int]] = {}
            full = 0  # entries of `level` already `length` long: once all are and no room is left, stop
            for sid, end in self._hits(tuple(ctx[-n:]), sibling, scan):
                if sid == sibling and end == len(ctx) - 1:
                    continue  # the suffix itself
                cont = self.seqs[sid][end + 1 : end + 1 + length]
                if not cont or cont[0] in best:
                    continue
                have = level.get(cont[0])
                if have is None:
                    if len(best) + len(level) < limit:
                        level[cont[0]] = cont
                        full += len(cont) == length
                elif len(cont) > len(have):
                    level[cont[0]] = cont
                    full += len(cont) == length
                if full == len(level) and len(best) + len(level) >= limit:
                    break
            best.update(level)
            if len(best) >= limit and all(len(c) == length for c in best.values()):
                break
        return list(best.values())

    def propose_nodes(self, sibling: int, arm: Arm) -> Nodes:
        """`propose` as plain lists (tokens, parents, depth): `pad_nodes` batches many in one go."""
        ctx = self.seqs.get(sibling)
        if not ctx:
            raise ValueError(f"sibling {sibling} has no tokens yet")
        return trie_nodes(ctx[-1], self.continuations(sibling, arm.steps, arm.topk), arm.draft_tokens)

    def propose(self, sibling: int, arm: Arm) -> DraftTree:
        """A draft tree rooted at the sibling's last token, merged from its best continuations."""
        return pad_nodes([self.propose_nodes(sibling, arm)])[0]


Nodes = tuple[list[int], list[int], list[int]]  # one tree's tokens, parents, depth (node 0 = root)


def trie_nodes(root: int, continuations: Sequence[Sequence[int]], max_nodes: int) -> Nodes:
    """Merge token lists into a trie below `root` (in priority order, stopping at max_nodes nodes)."""
    tokens, parents, depth = [root], [-1], [0]
    child: dict[tuple[int, int], int] = {}
    for cont in continuations:
        node = 0
        for tok in cont:
            nxt = child.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = len(tokens)
                child[(node, tok)] = nxt
                tokens.append(int(tok))
                parents.append(node)
                depth.append(depth[node] + 1)
            node = nxt
    return tokens, parents, depth


def trie_tree(root: int, continuations: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
    """`trie_nodes` as a one-row DraftTree."""
    return pad_nodes([trie_nodes(root, continuations, max_nodes)])[0]


def pad_nodes(trees: Sequence[Nodes]) -> tuple[DraftTree, torch.Tensor]:
    """`pad_trees` for trees still held as lists: one tensor per field for the whole batch (building a
    tensor per tree cost more than the matching on a CPU host, at every speculative step)."""
    n = max(len(t[0]) for t in trees)
    tok = [t[0] + [-1] * (n - len(t[0])) for t in trees]
    par = [t[1] + [0] * (n - len(t[1])) for t in trees]
    dep = [t[2] + [1] * (n - len(t[2])) for t in trees]
    sc = [[0.0] * len(t[0]) + [float("-inf")] * (n - len(t[0])) for t in trees]
    tree = DraftTree(torch.tensor(tok), torch.tensor(par), torch.tensor(dep), torch.tensor(sc, dtype=torch.float32))
    return tree, torch.tensor([len(t[0]) for t in trees])


def pad_trees(trees: Sequence[DraftTree]) -> tuple[DraftTree, torch.Tensor]:
    """Stack single trees of different sizes into [B, N_max]. Padding nodes hang off the root with token
    -1, which no target token equals, so acceptance never takes them. Returns (tree, node counts [B])."""
    n = max(t.num_nodes for t in trees)
    counts = torch.tensor([t.num_nodes for t in trees])

    def pad(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, n - x.shape[1]), value=value)

    tok = torch.cat([pad(t.tokens, -1) for t in trees])
    par = torch.cat([pad(t.parents, 0) for t in trees])
    dep = torch.cat([pad(t.depth, 1) for t in trees])
    sc = torch.cat([pad(t.score, float("-inf")) for t in trees])
    return DraftTree(tok, par, dep, sc), counts
