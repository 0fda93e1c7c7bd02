"""Offline acceptance length: the pure scoring rule by hand, and the batched chain simulation
against a slow one-start-at-a-time reference that re-runs the drafter causally over its own chain."""

from __future__ import annotations

import torch

from tlt.model.drafter import Drafter, DrafterConfig
from tlt.services.drafter.acceptance import accept_lengths, chain_drafts


def tiny_drafter(seed: int = 0, vocab: int = 11, h: int = 16) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=h, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32, vocab_size=vocab)
    embed = torch.randn(vocab, h)
    lm_head = torch.randn(vocab, h)
    return Drafter(cfg, embed, lm_head).eval()


def test_accept_lengths_by_hand() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    actual = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 2, 3], [4, 4, 4]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True] * 3, [True, True, False]])
    # all three accepted -> 4; first only -> 2; none -> 1; two valid matches then truncated -> 3
    assert accept_lengths(drafts, actual, valid).tolist() == [4, 2, 1, 3]


def slow_chain(d: Drafter, tokens: torch.Tensor, feats: torch.Tensor, t: int, depth: int) -> list[int]:
    ids = list(tokens[1 : t + 2].tolist())
    hs = [feats[j] for j in range(t + 1)]
    out = []
    with torch.no_grad():
        for _ in range(depth):
            n = len(ids)
            h = d(torch.tensor([ids]), torch.stack(hs)[None], torch.arange(1, n + 1)[None])
            last = h[0, -1]
            tok = int(d.compute_logits(last).argmax())
            out.append(tok)
            ids.append(tok)
            hs.append(last)
    return out


def test_chain_drafts_match_slow_reference() -> None:
    d = tiny_drafter()
    g = torch.Generator().manual_seed(1)
    n, depth = 12, 4
    tokens = torch.randint(0, 11, (n,), generator=g)
    feats = torch.randn(n, 16, generator=g)
    drafts, actual, valid = chain_drafts(d, tokens, feats, depth, first_start=2)
    assert drafts.shape == (n - 2 - 2, depth)
    for i, t in enumerate(range(2, n - 2)):
        assert drafts[i].tolist() == slow_chain(d, tokens, feats, t, depth), f"start {t}"
        for k in range(depth):
            assert bool(valid[i, k]) == (t + k + 2 < n)
            if valid[i, k]:
                assert int(actual[i, k]) == int(tokens[t + k + 2])


def test_a_drafter_that_copies_the_target_accepts_everything() -> None:
    """Stored tokens made of the drafter's own greedy chain are accepted to full depth."""
    d = tiny_drafter(seed=3)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(3, 16, generator=g)
    tokens = torch.randint(0, 11, (2,), generator=g)
    chain = slow_chain(d, tokens, torch.cat([feats[:1]]), 0, 5)
    seq = torch.cat([tokens, torch.tensor(chain)])
    # features after h_0 are never used by the start-0 chain except as context; give random ones
    f = torch.cat([feats[:1], torch.randn(len(seq) - 1, 16, generator=g)])
    drafts, actual, valid = chain_drafts(d, seq, f, 5)
    lens = accept_lengths(drafts, actual, valid)
    assert int(lens[0]) == 6


def test_chain_drafts_stops_between_its_drafter_passes_when_told() -> None:
    """The coordinator's gate evaluates while every replica is idle and stops when one turns busy. It asked only
    between two samples, so a rollout that started meanwhile waited for the rest of a sample (depth + 1 drafter
    passes over it); now it is asked before each pass past the first. Not told, the drafts are unchanged."""
    import pytest

    from tlt.services.drafter.acceptance import EvaluationInterrupted

    d = tiny_drafter()
    g = torch.Generator().manual_seed(1)
    tokens, feats = torch.randint(0, 11, (12,), generator=g), torch.randn(12, 16, generator=g)
    passes = []
    hook = d.register_forward_hook(lambda *a: passes.append(1))
    asked = []
    with pytest.raises(EvaluationInterrupted):
        chain_drafts(d, tokens, feats, 4, should_stop=lambda: asked.append(len(passes)) or len(asked) == 2)
    assert asked == [1, 2]  # before the second and the third pass; the third never ran
    passes.clear()
    drafts = chain_drafts(d, tokens, feats, 4, should_stop=lambda: False)[0]
    hook.remove()
    assert len(passes) == 4 and torch.equal(drafts, chain_drafts(d, tokens, feats, 4)[0])


def test_walked_lengths_start_where_the_previous_step_ended() -> None:
    """A rollout's verify step starts where the previous one ended: the positions inside an accepted run are never
    start points. Averaged over every start, the lengths below read 14 / 8 = 1.75; walked, 8 / 3 = 2.67."""
    from tlt.services.drafter.acceptance import walked_lengths

    assert walked_lengths(torch.tensor([3, 2, 1, 1, 4, 1, 1, 1])).tolist() == [3, 1, 4]
    assert walked_lengths(torch.tensor([1, 1, 2, 9, 1])).tolist() == [1, 1, 2, 1]
    assert walked_lengths(torch.zeros(0, dtype=torch.long)).tolist() == []


def test_the_gate_scores_the_steps_a_rollout_would_take() -> None:
    """mean_accept_length averaged the accept length over every start point, so an easy stretch counted once per
    token of it where the rollout verifies it once: an audit read 1.519 from the gate and 1.369 in the rollout for
    the same drafter and sequences (1.386 walked). Here the stored response is the drafter's own chain (accepted
    whole from the first start) then random tokens: walked, that run is one step of 6."""
    import numpy as np

    from tlt.services.drafter.acceptance import mean_accept_length
    from tlt.services.drafter.packing import Sample

    d = tiny_drafter(seed=3)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(16, 16, generator=g).half().float()  # fp16-exact: a Sample stores fp16
    tokens = torch.randint(0, 11, (2,), generator=g)
    chain = slow_chain(d, tokens, feats[:1], 0, 5)
    seq = torch.cat([tokens, torch.tensor(chain), torch.randint(0, 11, (9,), generator=g)])
    smp = Sample("s0@0", seq.numpy().astype(np.int32), feats.numpy().astype(np.float16), 1, 0)
    drafts, actual, valid = chain_drafts(d, seq, feats, 5)
    lens = accept_lengths(drafts, actual, valid).tolist()
    assert lens[0] == 6 and len(lens) == 14
    walk, t = [], 0
    while t < len(lens):
        walk.append(lens[t])
        t += lens[t]
    assert sum(lens) / len(lens) != sum(walk) / len(walk)  # the case tells the two apart
    mean, steps = mean_accept_length(d, [smp], 5)
    assert steps == len(walk) and abs(mean - sum(walk) / len(walk)) < 1e-9, (mean, steps, walk, lens)
    # two samples: the mean is over all their steps (tokens per verify step), not a mean of means
    short = Sample("s1@0", seq[:8].numpy().astype(np.int32), feats[:8].numpy().astype(np.float16), 1, 0)
    both, n = mean_accept_length(d, [smp, short], 5)
    assert n == len(walk) + 1 and abs(both - (sum(walk) + 6) / n) < 1e-9



def test_the_gate_scores_only_the_response_of_a_sample_with_a_prompt() -> None:
    """A rollout drafts from its first response position on: h at response_start - 1 predicts the first response
    token, so the gate walks each sample from start response_start - 1, never through the prompt. Here the prompt
    is the drafter's own chain (accepted whole from start 0: an accept length of 6) and the rest random tokens;
    scored from position 0, every sample below would read 9 steps of mean 14 / 9 = 1.56, the step of 6 included,
    which no rollout takes."""
    import numpy as np

    from tlt.services.drafter.acceptance import mean_accept_length
    from tlt.services.drafter.packing import Sample

    d = tiny_drafter(seed=3)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(16, 16, generator=g).half().float()  # fp16-exact: a Sample stores fp16
    tokens = torch.randint(0, 11, (2,), generator=g)
    chain = slow_chain(d, tokens, feats[:1], 0, 5)
    seq = torch.cat([tokens, torch.tensor(chain), torch.randint(0, 11, (9,), generator=g)])
    # per start t = 0..13 (the batched chain matches the slow reference: above); the 2 at start 3 is the chain's
    # own tail (d_1 = x_5 from h_3), the random tokens are never drafted
    assert accept_lengths(*chain_drafts(d, seq, feats, 5)).tolist() == [6, 1, 1, 2] + [1] * 10
    # walked by hand from start response_start - 1 (a step starts where the previous one ended):
    #   response_start 7  -> starts 6..13, 8 steps of 1                          : 8 steps, mean 1
    #   response_start 4  -> start 3 (2 accepted: the next step starts at 5), 5..13 : 10 steps, mean 11 / 10
    #   response_start 10 -> starts 9..13                                        : 5 steps, mean 1
    #   response_start 1  -> start 0 (6), then 6..13                              : 9 steps, mean 14 / 9
    for response_start, want_steps, want_mean in ((7, 8, 1.0), (4, 10, 1.1), (10, 5, 1.0), (1, 9, 14 / 9)):
        smp = Sample("s0@0", seq.numpy().astype(np.int32), feats.numpy().astype(np.float16), response_start, 0)
        mean, steps = mean_accept_length(d, [smp], 5)
        assert (steps, round(mean, 9)) == (want_steps, round(want_mean, 9)), response_start


def test_each_chain_node_sits_at_the_position_the_target_verifies_it_at() -> None:
    """Draft k of start t is fed to the drafter at position t + 1 + k, after its parent's t + k (the true pairs
    (x_{j+1}, h_j) sit at j + 1), as the slow reference and the engine place it. The drafter above reads its
    attention too little for its argmax to notice a node placed one position early; with q, k and o scaled up
    (and a larger vocabulary) where a node sits changes its drafts."""
    vocab = 64
    d = tiny_drafter(vocab=vocab)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if any(f"{x}_proj" in name for x in "qko"):
                p.mul_(4)
    g = torch.Generator().manual_seed(1)
    n, depth = 12, 4
    tokens = torch.randint(0, vocab, (n,), generator=g)
    feats = torch.randn(n, 16, generator=g)
    drafts = chain_drafts(d, tokens, feats, depth, first_start=2)[0]
    assert drafts.tolist() == [slow_chain(d, tokens, feats, t, depth) for t in range(2, n - 2)]
