"""Statistical proof that speculative decoding samples exactly from the target distribution.

Target: a fixed random order-2 Markov model over a vocabulary of 8 (its logits depend on the last two
tokens), so the exact probability of every 3-token continuation is computable (512 outcomes). Drafter:
a deliberately imperfect order-1 model (the target's marginal plus noise). We generate 20,000
continuations with speculation on, exactly as the engine does: draft a tree or chain (sampled chains with the
DRAFT-stream uniform of each draft's position, as `EagleSource._chain` draws them), evaluate the target at
every node, and verify with the engine's own verify step, `spec.decoder._walk` (trees, chains, cut chains)
and `spec.decoder._rejection` (sampled chains): the counter uniforms they draw, the filters they apply and
the accept rule they call are the engine's, not a copy (a copy proved the maths while the engine's residual
draw could take the wrong stream unseen). The empirical distribution is compared with the exact one by a
chi-square test (cells with expected count < 5 merged). A deliberately broken rule (accept a child whenever
it is the target's argmax; for rejection sampling, accept a draft whenever it is the target's argmax),
patched into those same engine functions, must fail the same test: that proves the test has power.
Rejection sampling is also run with an overconfident drafter (its logits sharpened): with the plain one
p(argmax) < q(argmax) almost everywhere, so the rule accepts the argmax anyway and the argmax-accepting
variant went undetected.
Every uniform is the engine's counter-based one (`spec/rng.py`: a hash of the sequence key, the token
position and the stream, keys from `seed_for` as for the n samples of one request): the tests are also
the proof that those uniforms are good enough, for plain sampling ("plain": one draw per position) and for
every speculative path.
Nothing is faked: the target is a lookup table instead of a transformer only because exactness needs it.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import replace
from unittest import mock

import pytest
import torch
from scipy.stats import chisquare

from tlt.services.rollout.engine.sequence import seed_for
from tlt.services.rollout.spec import decoder as spec_decoder
from tlt.services.rollout.spec.accept import (
    chain_accept_rejection,
    cut_sampled_chain,
    node_targets,
    sample_probs,
    tree_accept,
)
from tlt.services.rollout.spec.filters import filtered_probs
from tlt.services.rollout.spec.rng import DRAFT, counter_uniforms, key_tensor
from tlt.services.rollout.spec.tree import Arm, DraftTree, build_tree, chain_tree

V, L, N_SAMPLES = 8, 3, 20_000
PROMPT = (3, 5)


def _models(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, V, generator=g) * 1.5  # logits[prev, last] -> next
    marginal = target.logsumexp(0) - torch.log(torch.tensor(float(V)))
    drafter = (marginal + 0.8 * torch.randn(V, V, generator=g)).log_softmax(-1)  # log p[last] -> next
    return target, drafter


def _exact(target: torch.Tensor, temperature: float, top_p: float) -> dict[tuple[int, ...], float]:
    q = filtered_probs(target, temperature, 0, top_p)
    out = {}
    for ys in itertools.product(range(V), repeat=L):
        ctx, pr = list(PROMPT), 1.0
        for y in ys:
            pr *= float(q[ctx[-2], ctx[-1], y])
            ctx.append(y)
        out[ys] = pr
    return out


def _overconfident(drafter: torch.Tensor, sharpness: float) -> torch.Tensor:
    """The drafter with its log-probabilities scaled by `sharpness` (> 1: more mass on its own top tokens),
    so that p(x) > q(x) at the target's argmax x often enough for a rule that accepts it blindly to show."""
    return (drafter * sharpness).log_softmax(-1)


def _run_spec(target, drafter, temperature, top_p, mode: str, arm: Arm, seed: int = 1) -> tuple[torch.Tensor, float]:
    """Generate N_SAMPLES continuations of length L with speculation; returns [N, L] and the mean
    number of drafts accepted per verify step (so the tests can check speculation really happened)."""
    gen = torch.Generator().manual_seed(seed)
    b = N_SAMPLES
    keys = key_tensor([seed_for(seed, i) for i in range(b)])  # one request's samples: consecutive indices
    out = torch.full((b, L + arm.steps + 1), -1, dtype=torch.long)
    count = torch.zeros(b, dtype=torch.long)
    prev = torch.full((b,), PROMPT[0])
    last = torch.full((b,), PROMPT[1])
    rows = torch.arange(b)
    accepted = []
    while bool((count < L).any()):
        first = count[:, None]  # position (in the continuation) of the token the root's child takes
        if mode in REJECTION:
            drafts, p_steps, tok = [], [], last
            for i in range(arm.steps):
                p = drafter[tok].exp()
                tok = sample_probs(p, counter_uniforms(keys, first + i, DRAFT)[:, 0])
                drafts.append(tok)
                p_steps.append(p)
            tree = chain_tree(last, torch.stack(drafts, 1))
        elif mode == "plain":  # no speculation: a root-only tree, one draw per position
            tree = chain_tree(last, torch.empty(b, 0, dtype=torch.long))
        else:
            tree = build_tree(last, lambda step, beam, beam_tok: drafter[beam_tok], arm)
        if mode == "cut":  # confidence-cut chains (chain_min_prob): each row keeps a random number of
            keep = torch.randint(0, arm.steps + 1, (b, 1), generator=gen)  # drafts, -1 past its cut
            cut = torch.arange(tree.num_nodes)[None, :] > keep
            tree = DraftTree(tree.tokens.masked_fill(cut, -1), tree.parents, tree.depth, tree.score)
        par = tree.parents.clamp(min=0)
        toks = tree.tokens.clamp(min=0)  # cut nodes: any row of the table (the engine gives them zero logits)
        node_prev = torch.where(tree.parents >= 0, toks.gather(1, par), prev[:, None])
        logits = target[node_prev, toks]  # [B, N, V]: q at every node in one "forward"
        # the engine's per-row filters (SamplingParams as decoder.decode builds them) and its verify functions
        filters = (torch.full((b,), float(temperature)), torch.zeros(b, dtype=torch.long),
                   torch.full((b,), float(top_p)), torch.zeros(b))
        if mode in REJECTION:
            p_all, drafts, counts = torch.stack(p_steps, 1), tree.tokens[:, 1:], None
            if mode in ("rejection-cut", "broken-rejection-cut"):  # the engine's confidence cut on sampled
                # chains: a row keeps its drafts while their cumulative draft probability is >= CUT_PROB
                counts, r = cut_sampled_chain(drafts, p_all, CUT_PROB)
                drafts = drafts.masked_fill(torch.arange(arm.steps)[None, :] >= counts[:, None], -1)
                if mode == "rejection-cut":
                    p_all = r
                # broken: the kept drafts judged against p, which they were not drawn from (given the cut)
            broken = mock.patch.object(spec_decoder, "chain_accept_rejection", _accept_argmax)
            with broken if mode == "broken-rejection" else nullcontext():
                res, _ = spec_decoder._rejection(logits, chain_tree(last, drafts, None, p_all), filters, keys, first,
                                                 counts)
        else:
            broken = mock.patch.object(spec_decoder, "node_targets", _argmax_if_drafted(tree))
            with broken if mode == "broken" else nullcontext():
                res, _ = spec_decoder._walk(logits, tree, filters, keys, first)
        for j in range(res.tokens.shape[1]):
            valid = (j <= res.accept_len) & (count + j < out.shape[1])
            out[rows[valid], count[valid] + j] = res.tokens[valid, j]
        ends = res.tokens[rows, res.accept_len]
        before = torch.where(res.accept_len > 0, res.tokens[rows, (res.accept_len - 1).clamp(min=0)], last)
        accepted.append(float(res.accept_len[count < L].float().mean()))
        count += res.accept_len + 1
        prev, last = before, ends
    return out[:, :L], sum(accepted) / len(accepted)


def _accept_argmax(drafts, draft_probs, target_probs, u, counts=None):
    """A broken `chain_accept_rejection` for `_rejection` to call: accepts a draft whenever it is the target's
    argmax there (biased), whatever its uniform says."""
    u = u.clone()
    u[:, :-1] = u[:, :-1].masked_fill(drafts == target_probs[:, :-1].argmax(-1), 0.0)
    return chain_accept_rejection(drafts, draft_probs, target_probs, u=u, counts=counts)


def _argmax_if_drafted(tree: DraftTree):
    """A broken `node_targets` for `_walk` to call on `tree`: where the target's argmax at a node is one of
    its children, that child is the target's token (biased), whatever the draw says."""
    def targets(logits, *filters_and_u):
        nt = node_targets(logits, *filters_and_u)
        amax = logits.argmax(-1)
        is_child = (tree.parents[:, None, :] == torch.arange(tree.num_nodes)[None, :, None]) & (
            tree.tokens[:, None, :] == amax[:, :, None])
        return replace(nt, tokens=torch.where(is_child.any(-1), amax, nt.tokens))
    return targets


def _chi2(samples: torch.Tensor, exact: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for row in samples.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    n = samples.shape[0]
    impossible = [k for k in counts if exact.get(k, 0.0) == 0.0]
    assert not impossible, f"sampled continuations the filtered target gives probability 0: {impossible[:5]}"
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key, pr in exact.items():
        if pr == 0.0:
            continue
        if n * pr < 5:
            rest_o += counts.get(key, 0)
            rest_e += n * pr
        else:
            obs.append(counts.get(key, 0))
            exp.append(n * pr)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)  # only float rounding of the exact probabilities
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


OVERCONFIDENT = 3.0  # drafter sharpness for the rejection cases that can see an argmax-accepting rule
CUT_PROB = 0.1  # the cut chains' chain_min_prob: with the plain drafter rows keep 0 to 3 drafts, about evenly
REJECTION = ("rejection", "broken-rejection", "rejection-cut", "broken-rejection-cut")
CASES = [
    ("plain", Arm(1, 1, 1), 1.0),
    ("tree", Arm(3, 3, 8), 1.0),
    ("tree", Arm(2, 2, 5), 1.0),
    ("chain", Arm(3, 1, 4), 1.0),
    ("cut", Arm(3, 1, 4), 1.0),
    ("rejection", Arm(3, 1, 4), 1.0),
    ("rejection", Arm(3, 1, 4), OVERCONFIDENT),
    ("rejection-cut", Arm(3, 1, 4), 1.0),
    ("rejection-cut", Arm(3, 1, 4), OVERCONFIDENT),
]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("mode,arm,sharpness", CASES, ids=[f"{m}-{a}-x{s:g}" for m, a, s in CASES])
def test_speculative_sampling_matches_exact_target_distribution(mode, arm, sharpness, temperature, top_p):
    torch.set_num_threads(1)
    target, drafter = _models()
    samples, mean_accepted = _run_spec(target, _overconfident(drafter, sharpness), temperature, top_p, mode, arm)
    assert mode == "plain" or mean_accepted > 0.15, \
        f"the drafter is too poor for this test to exercise acceptance ({mean_accepted:.2f})"
    p = _chi2(samples, _exact(target, temperature, top_p))
    assert p > 1e-3, f"{mode} {arm} T={temperature} top_p={top_p}: chi-square p = {p:.2e}"


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_walk_emits_plain_samplings_tokens_for_the_same_keys(temperature, top_p):
    """Counter uniforms (rng.py): the walk draws the token at each position with the uniform plain sampling
    uses there, from the same q, so trees, chains and cut chains emit exactly plain sampling's tokens (here
    the logits are a table, so there is not even rounding between them), not only the same distribution."""
    torch.set_num_threads(1)
    target, drafter = _models()
    plain, _ = _run_spec(target, drafter, temperature, top_p, "plain", Arm(1, 1, 1))
    for mode, arm in (("tree", Arm(3, 3, 8)), ("tree", Arm(2, 2, 5)), ("chain", Arm(3, 1, 4)), ("cut", Arm(3, 1, 4))):
        spec, mean_accepted = _run_spec(target, drafter, temperature, top_p, mode, arm)
        assert mean_accepted > 0.15
        assert torch.equal(spec, plain), f"{mode} {arm}: {int((spec != plain).any(1).sum())} samples differ"


BROKEN = [("broken", Arm(3, 3, 8), 1.0), ("broken-rejection", Arm(3, 1, 4), OVERCONFIDENT),
          ("broken-rejection-cut", Arm(3, 1, 4), 1.0)]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("mode,arm,sharpness", BROKEN, ids=[f"{m}-{a}-x{s:g}" for m, a, s in BROKEN])
def test_broken_acceptance_rule_is_detected(mode, arm, sharpness, temperature, top_p):
    torch.set_num_threads(1)
    target, drafter = _models()
    samples, _ = _run_spec(target, _overconfident(drafter, sharpness), temperature, top_p, mode, arm)
    p = _chi2(samples, _exact(target, temperature, top_p))
    assert p < 1e-6, f"the chi-square test failed to detect a biased acceptance rule (p = {p:.2e})"


def test_greedy_walk_equals_plain_greedy_on_random_trees():
    target, _ = _models(3)
    g = torch.Generator().manual_seed(7)
    plain = list(PROMPT)
    for _ in range(40):
        plain.append(int(target[plain[-2], plain[-1]].argmax()))
    for trial in range(30):
        arm = Arm(int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g)), 0)
        arm = Arm(arm.steps, arm.topk, int(torch.randint(2, arm.max_nodes + 1, (1,), generator=g)))
        noise = torch.randn(V, V, V, generator=g) * (0.5 + trial / 10)
        ctx = list(PROMPT)
        while len(ctx) < len(plain):
            # drafter: a noisy copy of the target that sometimes agrees with its argmax
            pair = torch.tensor([[ctx[-2]]])

            def expand(step, beam, beam_tok, pair=pair):
                return (target + noise)[pair.expand_as(beam_tok), beam_tok].log_softmax(-1)

            tree = build_tree(torch.tensor([ctx[-1]]), expand, arm)
            par = tree.parents.clamp(min=0)
            node_prev = torch.where(tree.parents >= 0, tree.tokens.gather(1, par), torch.tensor([[ctx[-2]]]))
            nt = node_targets(target[node_prev, tree.tokens], 0.0)
            res = tree_accept(tree.tokens, tree.parents, nt.tokens)
            ctx.extend(res.emitted(0))
        assert ctx[: len(plain)] == plain, f"trial {trial} arm {arm}"
