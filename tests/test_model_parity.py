"""The native paged-KV model reproduces `transformers` logits (fp32, <= 1e-4 max abs).

Random-initialised Qwen2 / Qwen3 / Llama configurations built in code (GQA,
qkv bias where the family has it, q/k norm for Qwen3, tied and untied
embeddings, Llama-3 rope scaling). Every weight is perturbed so that norms
and biases are not their trivial init values. Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tlt.model.config import ModelConfig
from tlt.model.loader import validate_tensors
from tlt.model.transformer import AttentionMetadata, build_model

torch.set_num_threads(2)

BLOCK = 4


def random_hf_model(family: str, tie: bool, seed: int = 0, spread: float = 0.1):
    """A tiny random transformers model, its weights moved off their init values (1-d ones, norms and biases, by
    `spread` times a standard normal)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie, rms_norm_eps=1e-6,
    )
    if family == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        arch = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        hf_cfg = transformers.Qwen3Config(**common, head_dim=24, rope_theta=1e6)
        arch = transformers.Qwen3ForCausalLM
    else:
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        hf_cfg = transformers.LlamaConfig(**common, rope_parameters=rope)
        arch = transformers.LlamaForCausalLM
    hf_cfg.architectures = [arch.__name__]
    model = arch(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (spread if p.dim() == 1 else 0.05))
    return hf_cfg, model


def native_from_hf(hf_cfg, model, dtype=torch.float32):
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    validate_tensors(cfg, tensors)
    native = build_model(cfg, tensors, dtype=dtype, max_len=256)
    native.allocate_kv_cache(num_blocks=64, block_size=BLOCK)
    return cfg, native


def run(native, tokens, pos, meta):
    with torch.inference_mode():
        h = native(torch.tensor(tokens), torch.tensor(pos), meta)
        return native.compute_logits(h)


FAMILIES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)]


@pytest.mark.parametrize("family,tie", FAMILIES)
def test_chunked_prefill_and_decode_match_transformers(family, tie):
    hf_cfg, model = random_hf_model(family, tie)
    cfg, native = native_from_hf(hf_cfg, model)
    if family == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 24
    if family == "qwen2":
        assert cfg.attention_bias
    torch.manual_seed(1)
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (23, 9, 14)]
    with torch.no_grad():
        ref = [model(torch.tensor([s])).logits[0] for s in seqs]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    # step 1: seq0 chunk of 10, seq1 chunk of 5, seq2 whole prompt but last 1
    # step 2: seq0 next 12, seq1 rest (4), seq2 one token (decode-like)
    # step 3: seq0 last token (decode)
    plan = [[(0, 10), (0, 5), (0, 13)], [(10, 12), (5, 4), (13, 1)], [(22, 1), None, None]]
    got = [[] for _ in seqs]
    for step in plan:
        toks, pos, q_lens, ctx, bts, who = [], [], [], [], [], []
        for i, part in enumerate(step):
            if part is None:
                continue
            start, n = part
            toks += seqs[i][start : start + n]
            pos += list(range(start, start + n))
            q_lens.append(n), ctx.append(start), bts.append(tables[i]), who.append(i)
        meta = AttentionMetadata.build(q_lens, ctx, bts, BLOCK)
        logits = run(native, toks, pos, meta)
        off = 0
        for i, n in zip(who, q_lens):
            got[i].append(logits[off : off + n])
            off += n
    for i, s in enumerate(seqs):
        mine = torch.cat(got[i])
        assert mine.shape == ref[i].shape
        err = (mine - ref[i]).abs().max().item()
        assert err <= 1e-4, f"{family} tie={tie} seq{i}: max abs diff {err}"


def test_batched_decode_matches_transformers():
    hf_cfg, model = random_hf_model("qwen2", False, seed=3)
    cfg, native = native_from_hf(hf_cfg, model)
    torch.manual_seed(2)
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (5, 17, 11, 2)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    # prefill all but the last token, then decode the last token of all four in one batched step
    meta = AttentionMetadata.build([len(s) - 1 for s in seqs], [0] * 4, tables, BLOCK)
    run(native, sum((s[:-1] for s in seqs), []), sum((list(range(len(s) - 1)) for s in seqs), []), meta)
    meta = AttentionMetadata.build([1] * 4, [len(s) - 1 for s in seqs], tables, BLOCK)
    logits = run(native, [s[-1] for s in seqs], [len(s) - 1 for s in seqs], meta)
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = model(torch.tensor([s])).logits[0, -1]
        assert (logits[i] - ref).abs().max().item() <= 1e-4


def test_tree_mask_verify_equals_each_path_run_causally():
    """Nodes of a draft tree verified in one pass give each node the logits of its root-to-node path."""
    hf_cfg, model = random_hf_model("qwen3", False, seed=5)
    cfg, native = native_from_hf(hf_cfg, model)
    torch.manual_seed(4)
    prefix = torch.randint(0, 97, (9,)).tolist()
    # tree: node0 (root child), node1 child of 0, node2 child of 0, node3 child of 1, node4 (second root child)
    parents = [-1, 0, 0, 1, -1]
    nodes = torch.randint(0, 97, (5,)).tolist()
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    table = list(range(10))
    meta = AttentionMetadata.build([len(prefix)], [0], [table], BLOCK)
    run(native, prefix, list(range(len(prefix))), meta)
    meta = AttentionMetadata.build([5], [len(prefix)], [table], BLOCK, tree_masks=[mask])
    logits = run(native, nodes, [len(prefix) + d for d in depth], meta)
    for i in range(5):
        path, j = [], i
        while j >= 0:
            path.insert(0, nodes[j])
            j = parents[j]
        with torch.no_grad():
            ref = model(torch.tensor([prefix + path])).logits[0, -1]
        err = (logits[i] - ref).abs().max().item()
        assert err <= 1e-4, f"node {i}: {err}"


def test_copy_slots_moves_kv():
    hf_cfg, model = random_hf_model("llama", True, seed=6)
    cfg, native = native_from_hf(hf_cfg, model)
    native.k_caches[0].view(-1, cfg.num_kv_heads, cfg.head_dim)[3] = 1.5
    native.copy_slots(torch.tensor([3]), torch.tensor([10]))
    assert torch.all(native.k_caches[0].view(-1, cfg.num_kv_heads, cfg.head_dim)[10] == 1.5)
