"""Exact acceptance of drafts: tree walk (greedy and sampling) and chain rejection sampling.

Reference implementation in plain PyTorch; `tlt.kernels.tree_accept` is the fused GPU version of
`tree_accept` and must agree with it.

Tree, deterministic drafts (EAGLE top-k children, n-gram proposals). Let q_c be the target's
filtered, tempered distribution at node c (the engine computes all of them in one forward over the
tree). Walk from the root: draw y ~ q_c; if y is one of c's children accept it and descend, else
emit y and stop; at a leaf emit y. Each emitted token is then a draw from q at exactly the prefix it
extends, so the output is distributed as plain sampling from q, whatever the drafts are (they only
decide how many tokens one forward yields). Drawing one y per node up front and then walking is the
same procedure, and is what the kernel does. Greedy is the same walk with y = argmax q_c, so it
emits plain greedy decoding's tokens exactly. Sibling tokens must be distinct.

Chain, drafts x_i ~ p_i (a drafter's own distribution): accept x_i with probability
min(1, q_i(x_i) / p_i(x_i)); at the first rejection emit a draw from normalize(max(q_i - p_i, 0));
if all S drafts are accepted emit a bonus draw from q_S. P(emit x) = min(p, q)(x) + (1 - sum min(p, q))
* max(q - p, 0)(x) / sum max(q - p, 0) = q(x), since sum max(q - p, 0) = 1 - sum min(p, q).

Randomness: the engine passes uniforms `u` from the counter-based scheme of `rng.py`, a pure function of
(sequence key, token position, stream), never a generator's state. The tree walk draws the target's token
at a node of depth d with the PLAIN uniform of position t + d (t: the position the root's child takes),
the one plain decoding uses at that position, through the same `draw` from the same filtered logits: so a
seeded sample emits the tokens plain decoding emits, with speculation off, on any arm or drafter, static
or adaptive (up to floating-point rounding of the logits between batch shapes, as for greedy). Siblings
share their depth's uniform; only one path is emitted. Rejection-sampled chains cannot match plain
decoding token for token (whether a draft is kept depends on the drafter's p): they draw from their own
streams (DRAFT, ACCEPT, RESIDUAL), stay exact in distribution, but a seeded request whose steps take
that path (`SpecConfig.chain_sampling`) is reproducible only when the same steps do so again; a request
with `SamplingParams.reproducible` never takes it.
Without `u` (tests), uniforms come from `generator` (None: torch's global one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt.services.rollout.spec.filters import Param, filter_logits
from tlt.services.rollout.spec.tree import is_chain


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None = None,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """U[0, 1) of `shape` from `generator` (None: torch's global one), drawn on its device and then moved.
    The engine does not use it (its uniforms are counter-based, `rng.counter_uniforms`): tests and tools do."""
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def sample_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each distribution in probs [..., V] with its uniform u [...]; never picks p = 0."""
    cdf = probs.float().cumsum(-1)
    tok = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1).contiguous(), right=True).squeeze(-1)
    # Rounding can put u * total at the very end: fall back to the last token with mass.
    v = probs.shape[-1]
    last = v - 1 - (probs.flip(-1) > 0).float().argmax(-1)
    return torch.minimum(tok, last)


def draw(filtered: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of filtered logits [..., V] (`filter_logits`) with its uniform u [...]: the one
    draw plain sampling and the tree walk share, so equal logits and uniforms give equal tokens."""
    return sample_probs(filtered.softmax(-1), u)


@dataclass(frozen=True)
class NodeTargets:
    """What the target says at every node: the token it picks (argmax or one draw) and log q of it."""

    tokens: torch.Tensor  # [B, N]
    logprobs: torch.Tensor  # [B, N, V] log of the filtered distribution (greedy rows: the raw softmax)


def node_targets(
    logits: torch.Tensor,
    temperature: Param,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    u: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> NodeTargets:
    """logits [B, N, V] -> one target token per node: argmax where temperature == 0, else a draw from q.
    u [B, N]: each node's uniform (the engine: the PLAIN counter uniform of the position the node's token
    would take, see the module docstring); None: from `generator`. Greedy rows ignore theirs."""
    b, n, _ = logits.shape
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device).expand(b)
    greedy = temp == 0
    if bool(greedy.all()):  # nothing is drawn: no filters, no uniforms (greedy rows never use them)
        return NodeTargets(logits.argmax(-1), logits.float().log_softmax(-1))
    safe_temp = torch.where(greedy, torch.ones_like(temp), temp)
    filtered = filter_logits(logits, safe_temp[:, None], _rows(top_k, b)[:, None], _rows(top_p, b)[:, None],
                             _rows(min_p, b)[:, None])
    logq = filtered.log_softmax(-1)
    if u is None:
        u = uniforms((b, n), generator, logits.device)
    drawn = draw(filtered, u.to(logits.device))
    argmax = logits.argmax(-1)
    tokens = torch.where(greedy[:, None], argmax, drawn)
    logprobs = torch.where(greedy[:, None, None], logits.float().log_softmax(-1), logq)
    return NodeTargets(tokens, logprobs)


def _rows(x: Param, b: int) -> torch.Tensor:
    t = torch.as_tensor(x)
    return t.expand(b) if t.dim() == 0 else t


@dataclass(frozen=True)
class AcceptResult:
    """Outcome per sequence. accept_len [B] drafts accepted (bonus excluded); tokens [B, D+1] emitted
    tokens padded with -1 (accept_len + 1 valid); path [B, D+1] node index each token was emitted at
    (for a tree: the root, then the accepted nodes; padded with -1)."""

    accept_len: torch.Tensor
    tokens: torch.Tensor
    path: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.accept_len + 1

    def emitted(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.accept_len[b]) + 1].tolist()


def tree_accept(draft_tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor) -> AcceptResult:
    """Walk each tree from the root, descending while the target's token at the node is one of its children.

    draft_tokens, parents, target_tokens: [B, N]. Emits the accepted drafts and then the target token of
    the last node reached (the bonus). Exact for greedy and for sampling (see the module docstring).
    On CUDA the walk is the fused kernel `tlt.kernels.tree_accept`; elsewhere `tree_accept_torch`.
    """
    if draft_tokens.is_cuda:
        from tlt.kernels.tree_accept import tree_accept as kernel

        acc = kernel(draft_tokens, parents, target_tokens)
        width = int(acc.accept_len.max()) + 1
        path = acc.path[:, :width]
        k = torch.arange(width, device=path.device)[None]
        # the token emitted at step k is the target's choice at the node reached after k acceptances
        tokens = torch.where(k <= acc.accept_len[:, None], target_tokens.gather(1, path.clamp(min=0)),
                             torch.full_like(path, -1))
        return AcceptResult(acc.accept_len, tokens, path)
    return tree_accept_torch(draft_tokens, parents, target_tokens)


def tree_accept_torch(draft_tokens: torch.Tensor, parents: torch.Tensor, target_tokens: torch.Tensor) -> AcceptResult:
    """The vectorised PyTorch walk (one step per tree level for the whole batch); chains in one go."""
    b, n = draft_tokens.shape
    dev = draft_tokens.device
    if n > 1 and is_chain(parents):
        return _chain_accept(draft_tokens, target_tokens)
    rows = torch.arange(b, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    path = torch.full((b, n), -1, dtype=torch.long, device=dev)
    tokens = torch.full((b, n), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    accept_len = torch.zeros(b, dtype=torch.long, device=dev)
    for _ in range(n - 1):
        want = target_tokens[rows, cur]
        match = (parents == cur[:, None]) & (draft_tokens == want[:, None]) & active[:, None]
        found = match.any(1)
        if not bool(found.any()):
            break
        nxt = match.to(torch.int8).argmax(1)
        idx = rows[found]
        tokens[idx, accept_len[found]] = want[found]
        accept_len[found] += 1
        path[idx, accept_len[found]] = nxt[found]
        cur = torch.where(found, nxt, cur)
        active &= found
    tokens[rows, accept_len] = target_tokens[rows, cur]
    width = int(accept_len.max()) + 1
    return AcceptResult(accept_len, tokens[:, :width], path[:, :width])


def _chain_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> AcceptResult:
    """The walk on chains (node i's only child is i + 1): descend while the target's token at node i is
    draft i + 1, i.e. accept the longest prefix of matches; then emit the target's token there."""
    b, n = draft_tokens.shape
    match = draft_tokens[:, 1:] == target_tokens[:, :-1]  # [B, N-1]: the walk goes from node i to i + 1
    accept_len = match.long().cumprod(1).sum(1)
    width = int(accept_len.max()) + 1
    idx = torch.arange(width, device=draft_tokens.device)[None]
    keep = idx <= accept_len[:, None]
    path = torch.where(keep, idx, torch.full_like(idx, -1))
    tokens = torch.where(keep, target_tokens[:, :width], torch.full_like(path, -1))  # node k's choice = token k
    return AcceptResult(accept_len, tokens, path)


def emitted_logprobs(result: AcceptResult, node_logprobs: torch.Tensor) -> torch.Tensor:
    """log q of each emitted token at the node that emitted it: [B, D+1] (0 in padding)."""
    valid = result.tokens >= 0
    node = result.path.clamp(min=0)
    rows = torch.arange(node.shape[0], device=node.device)[:, None]
    lp = node_logprobs[rows, node, result.tokens.clamp(min=0)]
    return torch.where(valid, lp, torch.zeros_like(lp))


def cut_sampled_chain(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                      min_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The confidence cut of chains sampled from p: (counts [B], r [B, S, V]) for `chain_accept_rejection`.

    Row b keeps its drafts while their cumulative draft probability c_i = p_1(x_1) ... p_i(x_i) is at least
    `min_prob`. Whether draft i is offered then depends on the draft itself, so the proposal at position i
    is no longer p_i: it offers x ~ p_i only on A_i = {v : c_{i-1} p_i(v) >= min_prob}, so given an offer
    the draft is distributed as r_i = p_i restricted to A_i and renormalised, and with probability
    1 - p_i(A_i) nothing is offered. Rejection sampling against r_i (accept with min(1, q/r_i), else draw
    from max(q - r_i, 0)), and a draw from q where nothing was offered, emits q exactly:
    p_i(A_i) q + (1 - p_i(A_i)) q. Against p_i instead of r_i the rule is biased (the chi-square test shows
    it). `counts` and A_i come from the same products, so the kept draft is always in A_i. Past a row's cut
    r is never read."""
    p = draft_probs.float()
    x = draft_tokens.clamp(min=0)[..., None]  # padding (-1) gathers token 0, past every row's cut
    p_x = p.gather(-1, x).squeeze(-1)  # [B, S]
    c_prev = torch.cat([torch.ones_like(p_x[:, :1]), p_x[:, :-1].cumprod(1)], 1)  # c_{i-1}, c_0 = 1
    offered = (c_prev[..., None] * p) >= min_prob  # A_i [B, S, V]
    kept = offered.gather(-1, x).squeeze(-1)  # x_i in A_i
    counts = kept.long().cumprod(1).sum(1)
    r = p * offered
    mass = r.sum(-1, keepdim=True)
    r = torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)
    return counts, r


def chain_accept_rejection(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    u: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> AcceptResult:
    """Speculative sampling for a chain of drafts drawn from p.

    draft_tokens [B, S]; draft_probs [B, S, V] (p_i the drafts were drawn from); target_probs [B, S+1, V]
    (q_i at each draft's prefix, q_S after the last draft). Returns the same AcceptResult as a tree walk on
    the chain (path = node indices 0..accept_len). `u` [B, S+1]: u[:, i] decides draft i, u[:, S] draws the
    final token (the engine: counter uniforms of the ACCEPT and RESIDUAL streams, never the PLAIN one);
    None: from `generator`. `counts` [B] (None: S for every row): row b proposes only its first counts[b]
    drafts (a confidence cut, a function of the drafts alone); its tokens past them may be -1 and their p is
    never read. A row that accepts all its counts[b] drafts emits its last token from q at the cut: there is no
    draft there to reject, so it is the bonus draw of a chain of that length.

    Exact in distribution, but NOT token-identical to plain sampling with the same seed: which draft is
    kept depends on the drafter's p. Seeded reproducibility across speculation states (off, any arm,
    adaptive) holds for the tree walk only; see the module docstring and `SpecConfig.chain_sampling`.
    """
    b, s = draft_tokens.shape
    dev = draft_tokens.device
    if u is None:
        u = uniforms((b, s + 1), generator, dev)
    p = draft_probs.float()
    q = target_probs.float()
    idx = torch.arange(s + 1, device=dev)
    drafted = draft_tokens if counts is None else draft_tokens.clamp(min=0)  # cut drafts (-1): any row, never read
    p_x = p[:, :s].gather(-1, drafted[..., None]).squeeze(-1)
    q_x = q[:, :s].gather(-1, drafted[..., None]).squeeze(-1)
    # accept iff u < q/p  (q >= p: always accepted; p(x) > 0 because x was drawn from p; past a row's cut `counts`
    # masks the position)
    ok = u[:, :s] * p_x < q_x
    if counts is not None:
        ok = ok & (idx[None, :s] < counts.to(dev)[:, None])
    accept_len = ok.long().cumprod(1).sum(1)
    rows = torch.arange(b, device=dev)
    stop = accept_len.clamp(max=max(s - 1, 0))
    if s == 0:  # every row cut before its first draft (counts all 0): a plain draw from q
        p_stop = torch.zeros_like(q[:, 0])
    else:
        p_stop = p[rows, stop]
    if counts is not None:  # a row stopped at its cut has no draft there: its residual is q itself
        p_stop = p_stop * (accept_len < counts.to(dev))[:, None]
    residual = (q[rows, stop] - p_stop).clamp(min=0)
    # q == p at that node means rejection had probability 0; the fallback to q is only for rounding.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, q[rows, stop])
    final = torch.where((accept_len == s)[:, None], q[:, s], residual)
    last = sample_probs(final, u[:, s])
    tokens = torch.where(idx[None, :s] < accept_len[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    tokens = torch.cat([tokens, torch.full((b, 1), -1, dtype=torch.long, device=dev)], 1)
    tokens[rows, accept_len] = last
    path = torch.where(idx[None] <= accept_len[:, None], idx[None].expand(b, -1), torch.full_like(tokens, -1))
    width = int(accept_len.max()) + 1
    return AcceptResult(accept_len, tokens[:, :width], path[:, :width])
