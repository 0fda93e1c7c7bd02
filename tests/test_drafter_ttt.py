"""Training-time test (`Drafter.forward_unrolled`, `training.unrolled_targets`, `micro_step(ttt_steps=K)`).

The reference is the inference path the engine drafts with: `Drafter.forward` with a KV cache, fed the
true pairs up to a root and then one drafted pair per depth carrying the drafter's own previous output.
The unrolled step s at index j must equal depth s + 1 of that chain, must never see a true feature past
h_j, and must not cross packed segments. Tiny random drafters built in code.
"""

from __future__ import annotations

import pytest
import torch

from tiny_drafter import H, V, random_drafter

from tlt.model.drafter import Drafter, DrafterCache
from tlt.services.drafter.packing import PackedBatch, packed_pairs
from tlt.services.drafter.training import make_optimizer, micro_step, unrolled_targets


def _chain_reference(d: Drafter, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, root: int,
                     steps: int) -> list[torch.Tensor]:
    """Depths 1..steps drafted from root pair `root` of one sequence, through the cached inference path."""
    cache = DrafterCache(d.cfg, rows=1, capacity=8)
    h = d(ids[None, : root + 1], feats[None, : root + 1], pos[None, : root + 1], cache=cache)[0, -1]
    out = [h]
    for s in range(1, steps):
        h = d(ids[None, root + s : root + s + 1], h[None, None], pos[None, root : root + 1] + s, cache=cache)[0, 0]
        out.append(h)
    return out


@torch.no_grad()
def test_step_zero_is_the_plain_forward_and_later_steps_are_the_inference_chain():
    d = random_drafter()
    t, steps = 12, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (t,), generator=g)
    feats = torch.randn(t, H, generator=g)
    pos = torch.arange(1, t + 1)
    seg = torch.zeros(t, dtype=torch.long)
    outs = d.forward_unrolled(ids[None], feats[None], pos[None], seg[None], steps)
    assert len(outs) == steps
    plain = d(ids[None], feats[None], pos[None], segment_ids=seg[None])
    torch.testing.assert_close(outs[0], plain, rtol=1e-5, atol=1e-5)
    for root in (0, 3, t - steps):
        ref = _chain_reference(d, ids, feats, pos, root, steps)
        for s in range(steps):
            torch.testing.assert_close(outs[s][0, root], ref[s], rtol=1e-4, atol=1e-5, msg=f"root {root} step {s}")


@torch.no_grad()
def test_no_true_feature_past_the_root_is_seen_and_segments_stay_apart():
    d = random_drafter(3)
    t, steps, j = 10, 3, 4
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (1, t), generator=g)
    feats = torch.randn(1, t, H, generator=g)
    pos = torch.arange(1, t + 1)[None]
    seg = torch.zeros(1, t, dtype=torch.long)
    base = d.forward_unrolled(ids, feats, pos, seg, steps)
    changed = feats.clone()
    changed[0, j + 1 :] += 5.0  # true features after the root: a chain from root j never has them
    after = d.forward_unrolled(ids, changed, pos, seg, steps)
    for s in range(steps):
        torch.testing.assert_close(after[s][0, : j + 1], base[s][0, : j + 1])
        assert not torch.allclose(after[s][0, j + 1 :], base[s][0, j + 1 :])
    # two sequences packed in one row give what each gives alone (its first positions)
    a, b = 6, 4
    packed_seg = torch.tensor([[0] * a + [1] * b])
    packed_pos = torch.cat([torch.arange(1, a + 1), torch.arange(1, b + 1)])[None]
    both = d.forward_unrolled(ids, feats, packed_pos, packed_seg, steps)
    alone = d.forward_unrolled(ids[:, a:], feats[:, a:], packed_pos[:, a:], packed_seg[:, a:], steps)
    for s in range(steps):  # the unrolled tokens past the end differ (next segment's vs padding): check
        keep = b - s             # only indices whose step-s token lies inside the second segment
        torch.testing.assert_close(both[s][0, a : a + keep], alone[s][0, :keep], rtol=1e-5, atol=1e-5)


def test_unrolled_targets_shift_within_segments_only():
    tokens = torch.arange(8)[None]
    feats = torch.arange(8, dtype=torch.float32)[None, :, None].expand(1, 8, 2).clone()
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    loss = torch.tensor([[False, True, True, True, True, True, True, False]])
    p = packed_pairs(tokens, feats, seg, loss)
    # pairs j = 0..6; plain targets h_{j+1}; valid pairs: 0,1,2 (segment 0), 4,5 (segment 1)
    assert p.mask[0].tolist() == [True, True, True, False, True, True, False]
    t1, m1 = unrolled_targets(p, 1)
    assert t1[0, :, 0].tolist()[:6] == [2, 3, 4, 5, 6, 7]  # h_{j+2}
    assert m1[0].tolist() == [True, True, False, False, True, False, False]
    t2, m2 = unrolled_targets(p, 2)
    assert m2[0].tolist() == [True, False, False, False, False, False, False]
    assert float(t2[0, 0, 0]) == 3.0
    t0, m0 = unrolled_targets(p, 0)
    assert torch.equal(m0, p.mask) and torch.equal(t0, p.target)


def _batch(seed: int) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, 16), generator=g)
    feats = torch.randn(2, 16, H, generator=g).half()
    seg = torch.tensor([[0] * 9 + [1] * 7, [2] * 16])
    return PackedBatch(tokens, feats, seg, torch.ones(2, 16, dtype=torch.bool), 0, 3)


def test_micro_step_with_ttt_trains_every_weight_and_lowers_the_unrolled_loss():
    d = random_drafter(5)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    opt = make_optimizer(d, 3e-3)
    batch = _batch(0)
    first = micro_step(d, opt, batch, ttt_steps=3)
    for _ in range(40):
        last = micro_step(d, opt, batch, ttt_steps=3)
    assert float(last.loss.detach()) < 0.7 * float(first.loss.detach())
    assert all(not torch.equal(before[k], v) for k, v in d.state_dict().items())
    with pytest.raises(ValueError, match="ttt_steps"):
        micro_step(d, opt, batch, ttt_steps=0)
    # ttt_steps=1 is the plain loss
    d1, d2 = random_drafter(6), random_drafter(6)
    r1 = micro_step(d1, make_optimizer(d1, 1e-3), batch, ttt_steps=1)
    r2 = micro_step(d2, make_optimizer(d2, 1e-3), batch)
    assert float(r1.loss.detach()) == pytest.approx(float(r2.loss.detach()))


@pytest.mark.parametrize("ttt_steps", [1, 2])
def test_a_micro_step_told_to_stop_at_any_checkpoint_changes_nothing(ttt_steps):
    """should_stop (a worker's replica turned busy) is asked at checkpoints through a step: in the forward pass after
    the fc and after the attention (per unroll step), after the drafter's output and once the loss is computed, and in
    the backward pass (grad mode off there) at each output, attention output and fc output: 7 asks, 5k + 2 with
    ttt_steps = k. True at any of them abandons the step before the update: None, the drafter and the optimizer
    exactly as before, no gradient left behind, no hook left on the modules. Never true, the same step trains as usual.
    (It was asked once, after the forward pass: a BUSY during the backward pass, ~60% of a step, waited for the whole
    of it.)"""
    d = random_drafter(7)
    opt = make_optimizer(d, 1e-3)
    batch = _batch(1)
    micro_step(d, opt, batch, ttt_steps=ttt_steps)  # the optimizer has state to keep intact
    weights = {k: v.clone() for k, v in d.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    asks = 5 * ttt_steps + 2
    for stop_at in range(1, asks + 1):
        asked = []
        assert micro_step(d, opt, batch, ttt_steps=ttt_steps,
                          should_stop=lambda: asked.append(torch.is_grad_enabled()) or len(asked) >= stop_at) is None
        assert len(asked) == stop_at
        assert all(torch.equal(weights[k], v) for k, v in d.state_dict().items())
        after = opt.state_dict()["state"]
        assert all(torch.equal(moments[i][k], after[i][k]) for i in moments for k in moments[i])
        assert all(p.grad is None for p in d.parameters())
        assert not d.fc._forward_hooks and not d.layer.self_attn.o_proj._forward_hooks
    asked = []
    out = micro_step(d, opt, batch, ttt_steps=ttt_steps, should_stop=lambda: asked.append(torch.is_grad_enabled()))
    assert out is not None and asked == [True] * (2 * ttt_steps + 2) + [False] * (3 * ttt_steps)
    assert any(not torch.equal(weights[k], v) for k, v in d.state_dict().items())


def test_the_unrolled_loss_weighs_step_s_by_ttt_decay_to_the_s():
    """The TTT loss is sum_s ttt_decay**s * loss_s (step s: the drafter on its own outputs s times, its targets
    h_{j+s+1}). Built here from the pieces: the unrolled forward of a copy of the drafter, drafter_loss of each
    step against unrolled_targets; the step's record must read that weighted sum and the update must follow its
    gradient (plain SGD, lr 1, no clipping: the weights move by exactly minus the gradient)."""
    import copy

    from tlt.services.drafter.loss import drafter_loss

    batch = _batch(2)
    p = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask)
    for steps, decay in ((2, 0.5), (3, 0.25)):
        d = random_drafter(8)
        ref = copy.deepcopy(d).train()
        outs = ref.forward_unrolled(p.input_ids, p.features.float(), p.positions, p.segment_ids, steps)
        parts = []
        for s in range(steps):
            target, mask = unrolled_targets(p, s)
            parts.append(drafter_loss(outs[s], target.float(), ref.lm_head, mask).loss)
        assert all(x.item() > 0.1 for x in parts) and parts[1].item() != parts[0].item()
        want = parts[0] + decay * parts[1] + (decay**2 * parts[2] if steps == 3 else 0.0)  # by hand: 1, d, d^2
        want.backward()
        grads = {n: q.grad.clone() for n, q in ref.named_parameters()}
        before = {n: q.detach().clone() for n, q in d.named_parameters()}
        got = micro_step(d, torch.optim.SGD(d.parameters(), lr=1.0), batch, grad_clip=1e9, ttt_steps=steps,
                         ttt_decay=decay)
        assert float(got.loss) == pytest.approx(want.item(), rel=1e-5)
        assert float(got.loss) != pytest.approx(sum(x.item() for x in parts), rel=1e-3)  # unweighted would read this
        for n, q in d.named_parameters():
            torch.testing.assert_close(before[n] - q.detach(), grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_feature_noise_is_uniform_on_minus_noise_to_noise_and_seeded():
    """Offline warm-up's feature noise is U(-noise, noise) on the drafter's input features h_j (TLT.md section 3):
    zero-mean, so it blurs the features without shifting them. What the drafter is fed, less the batch's features:
    within [-noise, noise], reaching both ends, mean ~0 (7,680 draws: the mean's standard error is noise / 152),
    half of it below zero; the same generator seed gives the same noise; noise 0 feeds the features as they are."""
    noise = 0.3
    batch = _batch(3)
    clean = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask).features.float()

    def fed(noise: float, seed: int) -> torch.Tensor:
        d = random_drafter(9)
        seen = []
        hook = d.register_forward_pre_hook(lambda _m, args: seen.append(args[1].detach().clone()))
        micro_step(d, make_optimizer(d, 1e-3), batch, noise=noise, generator=torch.Generator().manual_seed(seed))
        hook.remove()
        assert len(seen) == 1
        return seen[0] - clean

    delta = fed(noise, 0)
    assert delta.numel() == 2 * 15 * H
    assert float(delta.abs().max()) <= noise + 1e-5
    assert float(delta.min()) < -0.95 * noise and float(delta.max()) > 0.95 * noise
    assert abs(float(delta.mean())) < 0.03 * noise  # one-sided U(0, noise) would read 0.5 * noise
    assert 0.45 < float((delta < 0).float().mean()) < 0.55
    assert float(delta.std()) == pytest.approx(noise / 3**0.5, rel=0.05)
    assert torch.equal(fed(noise, 0), delta) and not torch.equal(fed(noise, 1), delta)
    assert torch.equal(fed(0.0, 0), torch.zeros_like(delta))


def test_the_record_is_the_plain_pairs_and_the_update_is_clipped_to_norm_one():
    """With ttt_steps > 1 the step's record still reads the plain pairs' smooth_l1, soft_ce, top1 and token count
    (unroll step 0: what the warm-up's progress bar and the worker's window log show), its loss the weighted sum;
    the gradient is clipped to norm 1.0 unless told otherwise (TLT.md section 3), and make_optimizer's AdamW runs
    with betas (0.9, 0.95). Plain SGD at lr 1: the weights move by exactly the clipped gradient."""
    import copy

    from tlt.services.drafter.loss import drafter_loss

    batch = _batch(2)
    p = packed_pairs(batch.tokens, batch.features, batch.segment_ids, batch.loss_mask)
    d = random_drafter(8)
    ref = copy.deepcopy(d).train()
    outs = ref.forward_unrolled(p.input_ids, p.features.float(), p.positions, p.segment_ids, 3)
    parts = [drafter_loss(outs[s], t.float(), ref.lm_head, m) for s, (t, m) in
             enumerate(unrolled_targets(p, s) for s in range(3))]
    assert parts[1].smooth_l1 != pytest.approx(parts[0].smooth_l1, rel=1e-3)  # the steps' figures differ
    sum(0.8**s * r.loss for s, r in enumerate(parts)).backward()
    raw = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in ref.parameters()]))
    assert raw > 2.0  # the clip bites
    before = {n: q.detach().clone() for n, q in d.named_parameters()}
    got = micro_step(d, torch.optim.SGD(d.parameters(), lr=1.0), batch, ttt_steps=3)
    want = parts[0]
    assert (got.smooth_l1, got.soft_ce, got.top1, got.tokens) == pytest.approx(
        (want.smooth_l1, want.soft_ce, want.top1, want.tokens), rel=1e-5)
    moved = torch.linalg.vector_norm(torch.stack([(before[n] - q.detach()).norm() for n, q in d.named_parameters()]))
    assert float(moved) == pytest.approx(1.0, rel=1e-3)
    assert make_optimizer(d, 1e-3).param_groups[0]["betas"] == (0.9, 0.95)
