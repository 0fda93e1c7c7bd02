"""The EAGLE-style drafter: shapes from a HF config, shared frozen embed/lm_head, save/load of only its
own weights, segment-masked training forward, KV-cached and tree-masked inference, pair alignment.
Tiny models built in code; nothing downloaded."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlt.model.drafter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Drafter,
    DrafterCache,
    DrafterConfig,
    DrafterError,
    load_drafter,
    training_pairs,
)

H, V = 32, 50


def _hf_config() -> dict:
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen2ForCausalLM"]
    return d


def _drafter(seed: int = 0) -> tuple[Drafter, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    embed, lm_head = torch.randn(V, H), torch.randn(V, H) * 0.1
    d = Drafter(DrafterConfig.from_hf(_hf_config()), embed, lm_head)
    for p in d.parameters():  # non-trivial norm / biases
        p.data.add_(torch.randn_like(p) * 0.05)
    return d.eval(), embed, lm_head


def test_config_from_target():
    c = DrafterConfig.from_hf(_hf_config())
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.vocab_size) == (
        H, 4, 2, 8, 64, V)
    assert c.attention_bias  # Qwen2 has qkv bias
    assert DrafterConfig.from_json(c.to_json()) == c


def test_only_fc_and_layer_are_trainable_and_shared_tensors_are_by_reference():
    d, embed, lm_head = _drafter()
    names = set(dict(d.named_parameters()))
    assert names == set(d.state_dict())
    assert all(n.startswith(("fc.", "layer.")) for n in names)
    assert "layer.post_attention_layernorm.weight" in names
    assert not any("input_layernorm" in n for n in names)  # no input norm on the drafter layer
    ids = torch.randint(0, V, (2, 6))
    feats = torch.randn(2, 6, H)
    pos = torch.arange(6).expand(2, 6)
    out = d(ids, feats, pos)
    d.compute_logits(out).logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in d.parameters())
    assert embed.grad is None and lm_head.grad is None and not d.embed.requires_grad
    before = d(ids, feats, pos).detach()
    embed.add_(1.0)  # an in-place policy update is seen by the drafter
    assert not torch.allclose(d(ids, feats, pos), before)
    with pytest.raises(DrafterError, match="shape"):
        d.set_shared(torch.zeros(V + 1, H), lm_head)


def test_save_load_roundtrip_and_refusals(tmp_path):
    d, embed, lm_head = _drafter()
    d.save(tmp_path / "dr")
    assert sorted(p.name for p in (tmp_path / "dr").iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])
    saved = load_file(str(tmp_path / "dr" / WEIGHTS_FILE))
    assert all(k.startswith(("fc.", "layer.")) for k in saved)
    d2 = load_drafter(tmp_path / "dr", embed, lm_head).eval()
    ids, feats, pos = torch.randint(0, V, (1, 5)), torch.randn(1, 5, H), torch.arange(5)[None]
    assert torch.equal(d(ids, feats, pos), d2(ids, feats, pos))
    bad = dict(saved, **{"embed_tokens.weight": embed})
    save_file(bad, str(tmp_path / "dr" / WEIGHTS_FILE))
    with pytest.raises(DrafterError, match="embedding/lm_head"):
        load_drafter(tmp_path / "dr", embed, lm_head)
    wrong = dict(saved, **{"fc.weight": torch.zeros(H, H)})
    save_file(wrong, str(tmp_path / "dr" / WEIGHTS_FILE))
    with pytest.raises(DrafterError, match="fc.weight"):
        load_drafter(tmp_path / "dr", embed, lm_head)
    with pytest.raises(DrafterError, match="not a drafter folder"):
        load_drafter(tmp_path, embed, lm_head)


def test_packed_segments_do_not_attend_across_boundaries():
    d, _, _ = _drafter()
    a_ids, b_ids = torch.randint(0, V, (1, 4)), torch.randint(0, V, (1, 3))
    a_f, b_f = torch.randn(1, 4, H), torch.randn(1, 3, H)
    out_a = d(a_ids, a_f, torch.arange(4)[None])
    out_b = d(b_ids, b_f, torch.arange(3)[None])
    packed = d(torch.cat([a_ids, b_ids], 1), torch.cat([a_f, b_f], 1),
               torch.cat([torch.arange(4), torch.arange(3)])[None], segment_ids=torch.tensor([[0] * 4 + [1] * 3]))
    assert torch.allclose(packed[:, :4], out_a, atol=1e-5) and torch.allclose(packed[:, 4:], out_b, atol=1e-5)
    unmasked = d(torch.cat([a_ids, b_ids], 1), torch.cat([a_f, b_f], 1),
                 torch.cat([torch.arange(4), torch.arange(3)])[None])
    assert not torch.allclose(unmasked[:, 4:], out_b, atol=1e-3)  # the mask is what makes the difference


@torch.no_grad()
def test_cached_decoding_and_tree_mask_match_full_forward():
    d, _, _ = _drafter()
    ids, feats = torch.randint(0, V, (2, 7)), torch.randn(2, 7, H)
    pos = torch.arange(7).expand(2, 7)
    full = d(ids, feats, pos)
    cache = DrafterCache(d.cfg, rows=3, capacity=2)  # grows on demand
    rows = torch.tensor([2, 0])
    d(ids[:, :3], feats[:, :3], pos[:, :3], cache=cache, cache_rows=rows)  # prefill 3
    steps = [d(ids[:, i:i + 1], feats[:, i:i + 1], pos[:, i:i + 1], cache=cache, cache_rows=rows) for i in range(3, 7)]
    assert torch.allclose(torch.cat(steps, 1), full[:, 3:], atol=1e-5)
    assert cache.lengths.tolist() == [7, 0, 7]
    # a tree of 4 new nodes after a 3-token prefix: 0 -> 1, 0 -> 2, 1 -> 3 (node 0 follows the prefix)
    cache.truncate(rows, torch.tensor([3, 3]))
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    t_ids, t_f = torch.randint(0, V, (2, 4)), torch.randn(2, 4, H)
    t_pos = 3 + torch.tensor(depth).expand(2, 4)
    tree_out = d(t_ids, t_f, t_pos, cache=cache, cache_rows=rows, tree_mask=mask.expand(2, 4, 4))
    for node in range(4):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        seq_ids = torch.cat([ids[:, :3], t_ids[:, path]], 1)
        seq_f = torch.cat([feats[:, :3], t_f[:, path]], 1)
        ref = d(seq_ids, seq_f, torch.arange(3 + len(path)).expand(2, -1))
        assert torch.allclose(tree_out[:, node], ref[:, -1], atol=1e-5), node


def test_rows_with_different_lengths_share_one_cache():
    d, _, _ = _drafter()
    with torch.no_grad():
        ids, feats = torch.randint(0, V, (2, 6)), torch.randn(2, 6, H)
        cache = DrafterCache(d.cfg, rows=2, capacity=8)
        d(ids[:1, :5], feats[:1, :5], torch.arange(5)[None], cache=cache, cache_rows=torch.tensor([0]))
        d(ids[1:, :2], feats[1:, :2], torch.arange(2)[None], cache=cache, cache_rows=torch.tensor([1]))
        step = d(torch.stack([ids[0, 5], ids[1, 2]])[:, None], torch.stack([feats[0, 5], feats[1, 2]])[:, None],
                 torch.tensor([[5], [2]]), cache=cache)
        ref0 = d(ids[:1, :6], feats[:1, :6], torch.arange(6)[None])[0, -1]
        ref1 = d(ids[1:, :3], feats[1:, :3], torch.arange(3)[None])[0, -1]
    assert torch.allclose(step[0, 0], ref0, atol=1e-5) and torch.allclose(step[1, 0], ref1, atol=1e-5)


def test_training_pairs_alignment_by_hand():
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    feats = torch.arange(5, dtype=torch.float).view(1, 5, 1).expand(1, 5, 3) * 100  # h_t = 100 t
    mask = torch.tensor([[False, False, True, True, True]])  # prompt of 3: h_2 predicts the first response token
    p = training_pairs(tokens, feats, mask)
    # pair j = (x_{j+1}, h_j) -> h_{j+1}
    assert p.input_ids.tolist() == [[11, 12, 13, 14]]
    assert p.features[0, :, 0].tolist() == [0, 100, 200, 300]
    assert p.target[0, :, 0].tolist() == [100, 200, 300, 400]
    assert p.positions.tolist() == [[1, 2, 3, 4]]
    assert p.mask.tolist() == [[False, True, True, True]]


def test_load_tensors_refuses_lm_head_and_integer_tensors_and_changes_nothing():
    d, embed, lm_head = _drafter()
    own = {k: v.clone() for k, v in d.state_dict().items()}
    with pytest.raises(DrafterError, match="embedding/lm_head"):  # the target's head, not the drafter's
        d.load_tensors(dict(own, **{"lm_head.weight": lm_head}))
    ints = dict(own, **{"fc.weight": torch.ones_like(own["fc.weight"], dtype=torch.int64)})
    with pytest.raises(DrafterError, match="fc.weight: dtype torch.int64"):  # an int tensor is not cast silently
        d.load_tensors(ints)
    assert all(torch.equal(v, own[k]) for k, v in d.state_dict().items())
    d.load_tensors({k: v.to(torch.bfloat16) for k, v in own.items()})  # any float dtype is cast to ours
    assert all(torch.equal(v, own[k].to(torch.bfloat16).float()) for k, v in d.state_dict().items())
