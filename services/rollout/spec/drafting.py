"""Draft sources for the SpecDecoder: the model-free n-gram drafter and the learned EAGLE drafter.

Both turn a decode batch into a batch of draft trees (`DraftTree` [B, N] + node counts [B]) rooted at
each sequence's last token, and learn what was accepted through `observe`.

EAGLE state per sequence (a row of the drafter's own small KV cache): pairs (x_{t+1}, h_t) are fed
lazily. After a verify step, the emitted tokens and the target features that produced them are
exactly the next pairs, ending with (bonus token, h of the last accepted node): the root pair of the
next tree, so feeding them also yields the root's h' and the first draft level. If a sequence's pairs
do not reach its last token (it was decoded without speculation and nobody fed `observe`, or it is
new), its row restarts cold: a root-only tree this step (one plain verify, still lossless), after
which it is warm. The target's features for the cold context are never recomputed.
Memory: one contiguous K/V row per sequence (one layer, kv_heads x head_dim per position), the rows
sized up front for the sequences that speculate at once and the engine's context (SpecDecoder:
DRAFTER_CACHE_POSITIONS, capped by DRAFTER_CACHE_START_BYTES) and grown by doubling past that, and at
most `max_pending` buffered features per sequence.

Speed (it decides whether speculation pays on CPU): the drafter runs through `DrafterRuntime`
(`tlt/model/drafter_runtime.py`, fused and scripted); every sequence's pending pairs go through one
padded call (`_feed`); a chain (topk = 1) is drafted in one scripted call (`_chain`), a tree level by
level with one call per level for the whole batch (`_tree`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import replace

import torch

from tlt.model.drafter import Drafter, DrafterCache
from tlt.model.drafter_graphs import ChainGraphs
from tlt.model.drafter_runtime import DrafterRuntime
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.spec.accept import cut_sampled_chain
from tlt.services.rollout.spec.rng import DRAFT, counter_uniforms, key_tensor
from tlt.services.rollout.spec.ngram import NgramIndex, pad_nodes, pad_trees, trie_tree
from tlt.services.rollout.spec.tree import Arm, DraftTree, build_tree, chain_tree


def seq_key(seq: Sequence) -> tuple[str, int]:
    return (seq.request_id, seq.sample_index)


class NgramSource:
    """Suffix matching over each request's own tokens and its siblings' (one index per request)."""

    def __init__(self, min_n: int, max_n: int, max_groups: int = 1024) -> None:
        self.min_n, self.max_n, self.max_groups = min_n, max_n, max_groups
        self.groups: OrderedDict[str, NgramIndex] = OrderedDict()

    def _sync(self, seq: Sequence) -> NgramIndex:
        idx = self.groups.get(seq.request_id)
        if idx is None:
            idx = self.groups[seq.request_id] = NgramIndex(self.min_n, self.max_n)
            while len(self.groups) > self.max_groups:
                self.groups.popitem(last=False)
        self.groups.move_to_end(seq.request_id)
        have = len(idx.seqs.get(seq.sample_index, ()))
        idx.extend(seq.sample_index, seq.token_ids[have:])
        return idx

    def draft(self, seqs: list[Sequence], arm: Arm) -> tuple[DraftTree, torch.Tensor]:
        return pad_nodes([self._sync(s).propose_nodes(s.sample_index, arm) for s in seqs])

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Index the tokens the steps without speculation appended (what `draft` would do first)."""
        for s in seqs:
            self._sync(s)

    def observe(self, seqs, emitted, hidden, paths) -> None:
        """Nothing to do: indexes catch up from the sequences' tokens when next drafted."""

    def release(self, seq: Sequence) -> None:
        if seq.request_id in self.groups:
            self._sync(seq)  # keep a finished sibling's full text for the others

    def forget(self, request_id: str) -> None:
        """The request is over (every sibling finished or aborted): its index is never read again."""
        self.groups.pop(request_id, None)

    def reset(self) -> None:
        pass


class EagleSource:
    """EAGLE-2 tree drafting with the learned drafter and its own per-sequence KV rows."""

    def __init__(self, drafter: Drafter, capacity: int = 256, max_pending: int = 512, chain_min_prob: float = 0.0,
                 graphs: str = "off", graph_buckets: tuple[int, ...] = (1,), rows: int = 8) -> None:
        """rows: the cache's rows at the start, one per sequence drafting at once (the engine gives the most that
        speculate together: SpecDecoder); past that they grow by doubling, each growth a copy of the whole cache
        (a 256-sequence rollout that started at 8 rows copied it 5 times; with one growth of its positions, 2% of
        its CPU time, session 33).
        graphs ("cuda" / "emulate", SpecConfig.drafter_graphs): chains drafted through `ChainGraphs` for batches
        up to graph_buckets[-1]. The graphs hold the cache's addresses: it has one more row (the graphs' scratch
        row), and `capacity` positions, which the engine sizes for its context (SpecDecoder); past
        that they grow by doubling (each growth drops the graphs, which are captured again as used)."""
        self.drafter = drafter
        # chains: a row's drafts stop at the first whose cumulative draft probability is below this
        self.chain_min_prob = chain_min_prob
        self.chain_min_score = math.log(chain_min_prob) if chain_min_prob > 0 else float("-inf")
        self.runtime = DrafterRuntime(drafter)  # the inference path (fused, scripted); same maths
        self.max_pending = max_pending
        self.cold_starts = 0
        self.dtype = next(drafter.parameters()).dtype
        self.device = next(drafter.parameters()).device
        rows = max(1, rows) + (graphs != "off")  # + the graphs' scratch row
        self.cache = DrafterCache(drafter.cfg, rows=rows, capacity=capacity, dtype=self.dtype, device=self.device)
        self.rows: dict[tuple[str, int], int] = {}
        # with drafter graphs, row 0 is their padding rows' scratch row and no sequence's
        self.graphs = None if graphs == "off" else ChainGraphs(self.runtime, self.cache, 0, graph_buckets, graphs)  # type: ignore[arg-type]
        if self.graphs is not None:  # the rotary tables cover the cache's positions from the start: their growth
            self.runtime.ensure_chain(self.cache, capacity)  # drops the graphs as the cache's does
        self.free_rows: list[int] = list(range(1 if self.graphs is not None else 0, rows))[::-1]
        # per sequence: pending pairs (tokens, features [k, H], first position), the position of the
        # last pair fed, and the drafter output of that pair (h' of the root when it is the root pair)
        self.pending: dict[tuple[str, int], list] = {}  # [tokens, features, first position], extended in place
        self.fed_pos: dict[tuple[str, int], int] = {}
        self.last_h: dict[tuple[str, int], torch.Tensor] = {}

    def _row(self, key: tuple[str, int]) -> int:
        if key not in self.rows:
            if not self.free_rows:
                n = self.cache.k.shape[0]
                pad = (0, 0, 0, 0, 0, 0, 0, n)
                self.cache.k = torch.nn.functional.pad(self.cache.k, pad)
                self.cache.v = torch.nn.functional.pad(self.cache.v, pad)
                self.cache.lengths = torch.nn.functional.pad(self.cache.lengths, (0, n))
                self.free_rows = list(range(n, 2 * n))[::-1]
            self.rows[key] = self.free_rows.pop()
            self.cache.lengths[self.rows[key]] = 0
        return self.rows[key]

    # pending runs at most this long are fed together in one padded drafter call; longer ones (a backlog
    # buffered during plain decoding) alone, so that one long backlog does not pad every row
    FEED_BATCH_MAX = 16

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Feed the pairs buffered while the sequences were decoded without speculation (what `draft` would
        do first): the decoder times this apart, so the backlog is not charged to the arm drafted next."""
        self._feed_pending(seqs)

    @torch.inference_mode()
    def _feed(self, seqs: list[Sequence]) -> list[bool]:
        """Feed every sequence's pending pairs; per sequence, True when its root pair has been fed (warm)."""
        self._feed_pending(seqs)
        warm = []
        for s in seqs:
            key = seq_key(s)
            if self.fed_pos.get(key) != s.num_tokens - 1:
                self.cold_starts += 1
                self.cache.lengths[self.rows[key]] = 0
                self.fed_pos.pop(key, None)
                self.last_h.pop(key, None)
            warm.append(key in self.last_h)
        return warm

    @torch.inference_mode()
    def _feed_pending(self, seqs: list[Sequence]) -> None:
        """Feed the pending pairs of `seqs` into their drafter rows (short runs batched, long ones alone)."""
        jobs = []
        for s in seqs:
            key = seq_key(s)
            row = self._row(key)
            pend = self.pending.pop(key, None)
            if pend is not None:
                toks, feats, first = pend
                if self.fed_pos.get(key, first - 1) != first - 1:  # a gap: restart the row from these pairs
                    self.cache.lengths[row] = 0
                jobs.append((key, row, toks, feats, first))
        short = [j for j in jobs if len(j[2]) <= self.FEED_BATCH_MAX]
        for group in ([short] if short else []) + [[j] for j in jobs if len(j[2]) > self.FEED_BATCH_MAX]:
            self._feed_group(group)

    def _feed_group(self, jobs: list) -> None:
        """One drafter call over several rows' pending pairs, right-padded to the longest (padding is
        written past each row's new length, where the next append overwrites it, and never attended to
        by a real pair: new pairs attend causally)."""
        dev = self.device
        n = [len(j[2]) for j in jobs]
        t = max(n)
        ids = torch.tensor([j[2] + [0] * (t - len(j[2])) for j in jobs], device=dev)
        hdim = self.drafter.cfg.hidden_size
        feats = torch.zeros(len(jobs) * t, hdim, dtype=self.dtype, device=dev)
        # every row's pairs in one stack and one scatter (a stack and a copy per row were 2B launches on a GPU)
        at = torch.tensor([b * t + k for b in range(len(jobs)) for k in range(n[b])], device=dev)
        feats.index_copy_(0, at, torch.stack([f for j in jobs for f in j[3]]).to(dev, self.dtype))
        feats = feats.view(len(jobs), t, hdim)
        first = torch.tensor([j[4] for j in jobs], device=dev)
        out = self.runtime(ids, feats, first[:, None] + torch.arange(t, device=dev)[None], self.cache,
                           torch.tensor([j[1] for j in jobs], device=dev), new_lengths=torch.tensor(n, device=dev))
        for b, (key, _, _, _, f) in enumerate(jobs):
            self.fed_pos[key] = f + n[b] - 1
            self.last_h[key] = out[b, n[b] - 1]

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence], arm: Arm, sample: bool | list[bool] = False) -> tuple[DraftTree, torch.Tensor]:
        """Draft trees for `seqs` -> (trees [B, N], node counts [B]). sample (per sequence, or for all; chain
        arms only): a warm sequence's chain drafts are drawn from the drafter's own tempered distribution with
        counter uniforms (rng.py), and the tree carries `draft_probs` and `sampled` for rejection sampling of
        those rows; the other rows' drafts are deterministic (the tree walk verifies them). Per row, so a
        sequence's path never depends on what else is in the batch (a greedy or a cold neighbour)."""
        warm = self._feed(seqs)
        trees: list[DraftTree | None] = [None] * len(seqs)
        flags = sample if isinstance(sample, list) else [sample] * len(seqs)
        sampled = [i for i, w in enumerate(warm) if w and flags[i]] if arm.topk == 1 else []
        if sampled and len(sampled) == len(seqs):  # the usual case when sampling: one batch, nothing to join
            tree, counts = self._chain(seqs, arm, sample=True)
            return replace(_structure_on_cpu(tree), sampled=torch.ones(len(seqs), dtype=torch.bool)), counts.cpu()
        idx = [i for i, w in enumerate(warm) if w and i not in sampled]
        if sampled:
            s_tree, s_counts = self._chain([seqs[i] for i in sampled], arm, sample=True)
            s_tree = _structure_on_cpu(s_tree)
            for j, i in enumerate(sampled):
                trees[i] = _row(s_tree, j, int(s_counts[j]))
        if idx:
            warm_seqs = [seqs[i] for i in idx]
            if arm.topk == 1:
                batch, counts = self._chain(warm_seqs, arm)
            else:
                batch = self._tree(warm_seqs, arm)
                counts = torch.full((len(idx),), batch.num_nodes, dtype=torch.long)
            batch, counts = _structure_on_cpu(batch), counts.cpu()
            if len(idx) == len(seqs):  # all warm (the usual case): already one [B, N] batch
                return batch, counts
            for j, i in enumerate(idx):
                trees[i] = _row(batch, j, int(counts[j]))
        for i, s in enumerate(seqs):
            if trees[i] is None:
                trees[i] = trie_tree(s.token_ids[-1], [], 1)
        tree, counts = pad_trees(trees)  # type: ignore[arg-type]
        if sampled:  # the sampled rows' p beside the others' (zeros, never read: `sampled` says which rows)
            probs = s_tree.draft_probs  # [S, width, V]: as wide as the longest sampled row, at most the batch's
            assert probs is not None and tree.num_nodes >= probs.shape[1] + 1
            all_probs = probs.new_zeros(len(seqs), tree.num_nodes - 1, probs.shape[2])
            all_probs[torch.tensor(sampled, device=probs.device), : probs.shape[1]] = probs
            rows = torch.zeros(len(seqs), dtype=torch.bool)
            rows[sampled] = True
            tree = replace(tree, draft_probs=all_probs, sampled=rows)
        return tree, counts

    def _chain(self, seqs: list[Sequence], arm: Arm, sample: bool = False) -> tuple[DraftTree, torch.Tensor]:
        """topk = 1: the tree `build_tree` would keep (the first draft_tokens - 1 drafts of the greedy
        chain) without its bookkeeping, and (greedy) without drafting the levels that would be cut.

        With `chain_min_prob`, row b keeps only its drafts whose cumulative draft probability is at
        least that (a prefix: the probability only falls along a chain); the cut drafts become token -1,
        which no target token equals, so the prefix rule never accepts past them, and the node counts
        [B] (1 + kept drafts) tell the decoder to verify only the kept ones.

        sample=True: drafts drawn from the drafter's distribution under each sequence's sampling
        filters, draft i with the DRAFT-stream counter uniform of its position (num_tokens + i, rng.py):
        a function of the sequence's key and the position only, whatever its batch. The cut applies to
        them too, through `accept.cut_sampled_chain`: the tree's draft_probs are then the distributions the
        kept drafts were offered from (p restricted to what the cut keeps), which rejection sampling must
        use. They are drafted to the arm's full depth (no early stop, which would depend on the batch)."""
        dev = self.device
        keys = [seq_key(s) for s in seqs]
        rows = torch.tensor([self.rows[k] for k in keys], device=dev)
        root_pos = torch.tensor([s.num_tokens - 1 for s in seqs], device=dev)
        h = torch.stack([self.last_h[k] for k in keys])  # [B, H]: h' of each root pair
        depth = min(arm.steps, arm.draft_tokens - 1)
        roots = torch.tensor([s.token_ids[-1] for s in seqs], device=dev)
        params = u = None
        if sample:
            params = torch.tensor([[s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p]
                                   for s in seqs], dtype=torch.float32, device=dev)
            first = torch.tensor([s.num_tokens for s in seqs], device=dev)[:, None]
            u = counter_uniforms(key_tensor([s.rng_key for s in seqs], dev), first + torch.arange(depth, device=dev),
                                 DRAFT)
        # what the chain writes and the rotary rows it reads stay below the longest sequence + depth (a row holds
        # at most a pair per position): known here, so neither path reads the lengths back from the device for it
        need = max(s.num_tokens for s in seqs) + depth
        drafted = None
        if self.graphs is not None and (sample or self.chain_min_score == float("-inf")):
            self.runtime.ensure_chain(self.cache, need)
            flags = ChainGraphs.filter_flags((s.params.top_k, s.params.top_p, s.params.min_p) for s in seqs)
            drafted = self.graphs.chain(h, rows, root_pos, depth, params, u, flags, need)  # None: past the buckets
        if drafted is not None:
            drafts, scores, probs = drafted
        else:  # greedy chains stop drafting once every row is cut; sampled ones draft the full depth (see above)
            drafts, scores, probs = self.runtime.chain(h, self.cache, rows, root_pos, depth,
                                                       float("-inf") if sample else self.chain_min_score,
                                                       params, u, need)
        counts = torch.full((len(seqs),), drafts.shape[1] + 1, dtype=torch.long)
        if self.chain_min_score > float("-inf"):  # the confidence cut (off by default: no work)
            if sample:
                kept, probs = cut_sampled_chain(drafts, probs, self.chain_min_prob)
                keep = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < kept[:, None]
            else:
                keep = scores >= self.chain_min_score
                kept = keep.long().sum(1)
            width = int(kept.max())  # drafts past every row's cut are dropped
            drafts, scores = torch.where(keep, drafts, torch.full_like(drafts, -1))[:, :width], scores[:, :width]
            if probs is not None:
                probs = probs[:, :width]
            counts = 1 + kept.cpu()
        return chain_tree(roots, drafts, torch.cat([torch.zeros_like(scores[:, :1]), scores], 1), probs), counts

    def _tree(self, seqs: list[Sequence], arm: Arm) -> DraftTree:
        """EAGLE-2 drafting for warm sequences, vectorised over the batch. Candidate ids follow
        `build_tree`'s numbering (the same for every row); per row and candidate we keep its parent,
        its drafter output h', its offset in the drafter cache (beam nodes only) and the set of cache
        offsets of its drafted ancestors, so each level is one drafter forward with no python loop
        over rows."""
        d, dev = self.runtime, self.device
        b = len(seqs)
        keys = [seq_key(s) for s in seqs]
        rows = torch.tensor([self.rows[k] for k in keys], device=dev)
        committed = self.cache.lengths[rows].clone()
        root_pos = torch.tensor([s.num_tokens - 1 for s in seqs], device=dev)
        root_h = torch.stack([self.last_h[k] for k in keys])  # h' of each root pair
        hdim, k_beam = root_h.shape[-1], arm.topk
        n_max = arm.max_nodes
        n_slots = max(1, (arm.steps - 1) * k_beam)  # drafted beam nodes that enter the drafter cache
        parent = torch.full((b, n_max), -1, dtype=torch.long, device=dev)
        h_out = torch.zeros(b, n_max, hdim, dtype=root_h.dtype, device=dev)
        h_out[:, 0] = root_h
        offset = torch.full((b, n_max), -1, dtype=torch.long, device=dev)
        anc = torch.zeros(b, n_max, n_slots, dtype=torch.bool, device=dev)
        track = {"base": 1, "prev": None}

        def expand(step: int, beam: torch.Tensor, beam_tokens: torch.Tensor) -> torch.Tensor:
            if step == 0:
                track["prev"] = beam
                return d.compute_logits(root_h).float().log_softmax(-1)[:, None]
            # candidates created at step - 1 (ids base .. base + n_new - 1) are children of that beam
            prev, base = track["prev"], track["base"]
            n_new = prev.shape[1] * arm.topk
            par = prev.repeat_interleave(arm.topk, dim=1)
            parent[:, base : base + n_new] = par
            par_anc = anc.gather(1, par[..., None].expand(b, n_new, n_slots))
            par_off = offset.gather(1, par)
            par_anc |= torch.nn.functional.one_hot(par_off.clamp(min=0), n_slots).bool() & (par_off >= 0)[..., None]
            anc[:, base : base + n_new] = par_anc
            track["base"], track["prev"] = base + n_new, beam
            k = beam.shape[1]
            feats = h_out.gather(1, parent.gather(1, beam)[..., None].expand(b, k, hdim))  # pair (x_node, h'_parent)
            # a drafted node sees the verified context and, among drafted nodes, only its ancestors
            span = int(committed.max()) + (step - 1) * k
            key = torch.arange(span, device=dev)[None, None, :]
            rel = key - committed[:, None, None]
            node_anc = anc.gather(1, beam[..., None].expand(b, k, n_slots))
            drafted_ok = (rel >= 0) & (rel < (step - 1) * k) & node_anc.gather(
                2, rel.clamp(0, n_slots - 1).expand(b, k, span))
            pmask = (rel < 0) | drafted_ok
            out = d(beam_tokens.to(dev), feats, (root_pos[:, None] + step).expand(b, k), self.cache, rows,
                    tree_mask=torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k), prefix_mask=pmask)
            h_out.scatter_(1, beam[..., None].expand(b, k, hdim), out.to(h_out.dtype))
            offset.scatter_(1, beam, (step - 1) * k + torch.arange(k, device=dev).expand(b, k))
            return d.compute_logits(out).float().log_softmax(-1)

        tree = build_tree(torch.tensor([s.token_ids[-1] for s in seqs], device=dev), expand, arm)
        self.cache.truncate(rows, committed)  # drop the drafted nodes: only verified pairs stay
        return tree

    def observe(self, seqs: list[Sequence], emitted: list[list[int]], hidden: list[torch.Tensor], first_pos: list[int]) -> None:
        """After a verify step: emitted[i][k] was produced by the target feature hidden[i][k] at position
        first_pos[i] + k - 1, so the pairs are (emitted[i][k], hidden[i][k]) at positions first_pos[i] + k."""
        for s, toks, feats, pos in zip(seqs, emitted, hidden, first_pos):
            key = seq_key(s)
            old = self.pending.get(key)
            if old is not None and old[2] + len(old[0]) == pos:  # contiguous: extend in place (one plain
                old[0].extend(toks)                              # step adds one pair: no list copies)
                old[1].extend(feats)
                entry = old
            else:
                entry = self.pending[key] = [list(toks), list(feats), pos]
            extra = len(entry[0]) - self.max_pending
            if extra > 0:  # keep the newest pairs; the row restarts from them (a gap) when fed
                del entry[0][:extra], entry[1][:extra]
                entry[2] += extra

    def forget(self, request_id: str) -> None:
        """Nothing: per-sequence state is dropped in `release`."""

    def release(self, seq: Sequence) -> None:
        key = seq_key(seq)
        row = self.rows.pop(key, None)
        if row is not None:
            self.free_rows.append(row)
        for d in (self.pending, self.fed_pos, self.last_h):
            d.pop(key, None)

    def reset(self) -> None:
        """New drafter weights: every cached drafter K/V is stale; rows restart cold."""
        with torch.inference_mode():  # the cache was made under inference mode; a weight push arrives outside it
            self.cache.lengths.zero_()
        self.pending.clear()
        self.fed_pos.clear()
        self.last_h.clear()
        self.runtime.refresh()
        if self.graphs is not None:  # the new weights' graphs now, not inside the next rollout's first chains
            self.graphs.capture_all(self.graphs.depths, False in self.graphs.kinds, True in self.graphs.kinds)


def _row(tree: DraftTree, j: int, n: int) -> DraftTree:
    """Row j of a batch of trees, its first n nodes (the structure: `pad_trees` joins rows again)."""
    return DraftTree(tree.tokens[j : j + 1, :n], tree.parents[j : j + 1, :n], tree.depth[j : j + 1, :n],
                     tree.score[j : j + 1, :n])


def _structure_on_cpu(tree: DraftTree) -> DraftTree:
    """The tree's tokens, parents, depths and scores on the CPU, where the decoder builds its masks and counts and
    the n-gram source and cold rows build theirs (`pad_trees` joins them): a drafter on a GPU drafts there, and
    mixing its trees with CPU tensors raised "Expected all tensors to be on the same device" at the first verify
    step. `draft_probs` (the sampled chains' p, [B, N - 1, V]) stays on the drafter's device: the acceptance
    runs there. A no-op on CPU."""
    return DraftTree(tree.tokens.cpu(), tree.parents.cpu(), tree.depth.cpu(), tree.score.cpu(), tree.draft_probs,
                     tree.sampled)
