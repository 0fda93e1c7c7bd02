"""The engine on the Triton kernels (`EngineConfig.kernels = "triton"`) against its PyTorch path.

With kernels="triton" the model's decode and verify steps run fused add+RMSNorm, RoPE and paged
decode / tree attention as the kernels of `tlt.kernels`, over the engine's own paged KV cache
(prefill attention stays SDPA). On CPU that needs Triton's interpreter from process start, so
the `test_interpreter_*` cases below skip in a normal run and `test_engine_on_kernels_in_child`
runs them in a child `python -m pytest` started with TRITON_INTERPRET=1 (as
tests/test_kernels_interpreter.py does for the kernel parity cases). They compare whole
generations, kernels="torch" vs kernels="triton" (fp32: the interpreter's bf16 is not faithful):
greedy tokens identical, logprobs within 1e-4, for plain decode at batch 1 and 5 (mixed prompt
lengths, chunked prefill so decode rows and prefill chunks share steps, contexts over several KV
blocks, split-K attention) and with n-gram speculative decoding (draft trees through the tree
kernel). Nothing is faked: a tiny random Qwen2 (GQA, 2 layers) and the real kernels, interpreted.
This checks the kernels' logic inside the engine, NOT the compiled GPU path (no GPU here).

The other cases run in-process: the "auto" default stays on the PyTorch path on CPU, "triton"
on CPU without the interpreter fails at start, and the kernel tables of
`AttentionMetadata.build(for_kernels=True)` give the SDPA path's attention through the kernels'
PyTorch references.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernel_params import run_interpreter_child
from tlt.kernels.launch import interpreter_ready, resolve_impl
from tlt.model.layer_ops import onednn_works
from tlt.model.transformer import AttentionMetadata, attend_groups
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.types import GenerationRequest, SamplingParams

INTERPRETER_CASES = 5
needs_interpreter = pytest.mark.skipif(
    not interpreter_ready(), reason="needs TRITON_INTERPRET=1 from process start: runs in the child process"
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("kern") / "m", hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=256,
                             seed=2, weight_scale=0.03)


# ----------------------------------------------------------------------------- in-process


def test_engine_on_kernels_in_child() -> None:
    if interpreter_ready():
        pytest.skip("this process already runs the interpreter: the cases run directly")
    run_interpreter_child(["-k", "test_interpreter_", __file__], exactly=INTERPRETER_CASES)


def test_auto_is_the_pytorch_path_on_cpu(ckpt) -> None:
    assert EngineConfig().kernels == "auto"
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    engine = LLMEngine(ckpt, EngineConfig(block_size=4))
    assert engine.model.kernels == "torch" and not engine.runner.for_kernels
    assert engine.model._use_onednn == onednn_works(torch.float32)  # the CPU path is untouched: packed weights


def test_triton_on_cpu_needs_triton_interpret(ckpt) -> None:
    if interpreter_ready():
        pytest.skip("the interpreter is on in this process")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        LLMEngine(ckpt, EngineConfig(block_size=4, kernels="triton"))


def _tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


@pytest.mark.parametrize("q_lens, ctx, trees", [
    ([1, 1, 1], [5, 13, 0], False),      # decode, contexts over several blocks
    ([1, 6, 1, 3], [9, 2, 4, 0], False),  # decode rows (kernel) + prefill chunks (SDPA on both sides)
    ([3, 1, 5], [7, 10, 2], True),        # verify: trees of 3, 1 and 5 nodes, padded to 5
])
def test_kernel_tables_match_the_sdpa_path(q_lens, ctx, trees) -> None:
    """The kernels' inputs built once per step (int32 block tables, contexts + max_q, padded tree
    masks) give the same attention through the kernels' PyTorch references as the SDPA groups."""
    from tlt.model.kernel_ops import attend

    g = torch.Generator().manual_seed(0)
    bs, nblocks, kvh, nh, d = 4, 24, 2, 4, 8
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables, start = [], 0
    for q, c in zip(q_lens, ctx):
        n = (q + c + bs - 1) // bs
        tables.append(perm[start : start + n])
        start += n
    kc = torch.randn(nblocks, bs, kvh, d, generator=g)
    vc = torch.randn(nblocks, bs, kvh, d, generator=g)
    q = torch.randn(sum(q_lens), nh, d, generator=g)
    masks = [_tree_mask(n, g) for n in q_lens] if trees else None
    sdpa = AttentionMetadata.build(q_lens, ctx, tables, bs, tree_masks=masks)
    kern = AttentionMetadata.build(q_lens, ctx, tables, bs, tree_masks=masks, for_kernels=True)
    assert any(grp.kernel is not None for grp in kern.groups)
    for grp in kern.groups:
        if grp.kernel is not None:
            assert grp.kernel.block_tables.dtype == grp.kernel.context_lens.dtype == torch.int32
    want = attend_groups(q, kc, vc, sdpa, d**-0.5)
    got = attend_groups(q, kc, vc, kern, d**-0.5, functools.partial(attend, impl="torch"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("qk_norm", [False, True], ids=["qwen2", "qwen3"])
def test_pre_attention_matches_the_pytorch_layer(monkeypatch, qk_norm) -> None:
    """kernel_ops.pre_attention (qkv projection with its bias, Qwen3's per-head q/k norms with their weights,
    RoPE, the K/V written to their slots) gives layer_ops.pre_attention's q and cache. RoPE runs as the rotary
    kernel's PyTorch reference here (the kernel itself: tests/test_kernels_rotary.py): the rest is PyTorch on both
    paths. The interpreter cases' random checkpoints have all-ones norm weights, which hid a dropped weight."""
    from tlt.kernels.rotary import apply_rotary
    from tlt.model import kernel_ops
    from tlt.model.layer_ops import pre_attention

    monkeypatch.setattr(kernel_ops, "apply_rotary_triton", functools.partial(apply_rotary, impl="torch"))
    g = torch.Generator().manual_seed(4)
    t, hid, nh, kvh, d, slots_n = 5, 32, 4, 2, 8, 12
    x = torch.randn(t, hid, generator=g)
    ln1 = 1 + 0.3 * torch.randn(hid, generator=g)
    qkv_w = torch.randn((nh + 2 * kvh) * d, hid, generator=g) * 0.2
    qkv_b = torch.randn((nh + 2 * kvh) * d, generator=g) * 0.1
    norm = None
    if qk_norm:  # one weight for the q heads, one for the k heads, laid out per head as the model holds them
        qn, kn = 1 + 0.5 * torch.randn(d, generator=g), 1 + 0.5 * torch.randn(d, generator=g)
        norm = torch.cat([qn.expand(nh, d), kn.expand(kvh, d)])
    positions = torch.tensor([3, 4, 5, 5, 6])  # tree nodes at one depth share a position
    slots = torch.tensor([7, 2, 9, 0, 11])
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(16).float(), inv)] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    sin_signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], -1)
    eps = torch.tensor(1e-6)
    k_ref, v_ref = torch.zeros(slots_n, kvh, d), torch.zeros(slots_n, kvh, d)
    want = pre_attention(x, ln1, qkv_w, qkv_b, norm, False, eps, False, cos[positions][:, None],
                         sin_signed[positions][:, None], k_ref, v_ref, slots, nh, kvh, d)
    k_got, v_got = torch.zeros(slots_n, kvh, d), torch.zeros(slots_n, kvh, d)
    h = kernel_ops.rms(x, ln1, eps, True)
    got = kernel_ops.pre_attention(h, qkv_w, qkv_b, norm, eps, positions, cos, sin, k_got, v_got, slots, nh, kvh, d)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_got, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_got, v_ref, atol=1e-5, rtol=1e-5)

# ----------------------------------------------------------------------------- interpreter (child)


def _generate(ckpt, kernels: str, prompts, max_tokens: int, spec: bool = False, **engine_kw):
    engine = LLMEngine(ckpt, EngineConfig(kernels=kernels, **engine_kw))
    assert engine.model.kernels == kernels
    if spec:
        engine.enable_spec(SpecConfig(mode="static", static_arm="3_2_6", threshold=64, hysteresis_steps=1,
                                      drafter="ngram"))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    out = engine.generate([GenerationRequest(f"r{i}", tuple(p), params) for i, p in enumerate(prompts)])
    return engine, out


def _same(torch_out, triton_out) -> None:
    for a, b in zip(torch_out, triton_out):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4), (a.logprobs, b.logprobs)


def _prompts(lengths, repetitive: bool = False):
    g = torch.Generator().manual_seed(3)
    out = []
    for n in lengths:
        if repetitive:  # the n-gram drafter finds matches
            motif = torch.randint(3, 250, (int(torch.randint(2, 4, (1,), generator=g)),), generator=g).tolist()
            out.append((motif * 20)[:n])
        else:
            out.append(torch.randint(3, 250, (n,), generator=g).tolist())
    return out


@pytest.fixture
def calls(monkeypatch):
    """Counts the kernel launches the engine makes (wrapping the real functions)."""
    from tlt.model import kernel_ops

    counts: dict[str, int] = {}

    def counting(name, fn):
        def wrapper(*a, **kw):
            if kw.get("impl", "triton") == "triton":
                counts[name] = counts.get(name, 0) + 1
            return fn(*a, **kw)
        return wrapper

    for name in ("paged_decode_attention", "paged_tree_attention", "apply_rotary_triton",
                 "rmsnorm_triton", "fused_add_rmsnorm_triton"):
        monkeypatch.setattr(kernel_ops, name, counting(name, getattr(kernel_ops, name)))
    return counts


@needs_interpreter
def test_interpreter_decode_batch1_several_blocks(ckpt, calls) -> None:
    # block_size 2: the cache grows to 20 tokens in 10 blocks; past 8 blocks the decode kernel splits (flash decoding)
    prompts = _prompts([9])
    _, want = _generate(ckpt, "torch", prompts, 12, block_size=2)
    assert not calls
    _, got = _generate(ckpt, "triton", prompts, 12, block_size=2)
    _same(want, got)
    assert calls["paged_decode_attention"] == 2 * 11  # layers x decode steps (the first token comes from prefill)
    assert calls["apply_rotary_triton"] == 2 * 12 and calls["fused_add_rmsnorm_triton"] == 2 * 2 * 12


@needs_interpreter
def test_interpreter_decode_batch5_mixed_lengths(ckpt, calls) -> None:
    # 5 prompts of 3..13 tokens with a 16-token step budget: prefill is chunked, so steps mix decode rows
    # (decode kernel, gathered rows) with prefill chunks (SDPA); block_size 4 -> contexts over several blocks
    prompts = _prompts([3, 11, 6, 13, 8])
    # 5 tokens: 3 steps mixing prefill chunks and decode rows, then 4 decode-only steps at batch 5, 3 and 2
    _, want = _generate(ckpt, "torch", prompts, 5, block_size=4, max_num_batched_tokens=16)
    _, got = _generate(ckpt, "triton", prompts, 5, block_size=4, max_num_batched_tokens=16)
    _same(want, got)
    assert calls["paged_decode_attention"] > 0 and "paged_tree_attention" not in calls


@needs_interpreter
def test_interpreter_speculative_verify_tree_kernel(ckpt, calls) -> None:
    prompts = _prompts([7, 12, 10], repetitive=True)
    torch_engine, want = _generate(ckpt, "torch", prompts, 10, spec=True, block_size=4)
    engine, got = _generate(ckpt, "triton", prompts, 10, spec=True, block_size=4)
    _same(want, got)
    stats = engine.stats().spec
    assert stats["verify_steps"] > 0 and stats["drafted_tokens"] > 0
    untimed = lambda st: {k: v for k, v in st.items() if not k.endswith("seconds")}  # wall times differ run to run  # noqa: E731
    assert untimed(stats) == untimed(torch_engine.stats().spec)  # same drafts, same acceptances, same arms
    assert sum(c.spec.accepted_tokens for c in got) > sum(c.spec.verify_steps for c in got), "drafts were accepted"
    assert calls["paged_tree_attention"] == 2 * stats["verify_steps"]


@needs_interpreter
def test_interpreter_decode_graph_buckets_emulated(ckpt, calls) -> None:
    """decode_graphs = "emulate": plain decode steps on static buffers padded to a bucket (padding rows
    writing to the scratch block), tables at full width. Requests of different lengths make the batch
    shrink 5 -> 4 -> 3 -> 2 -> 1 through buckets 8, 4, 4, 2 and 1 (padding rows at batch 5 and 3). Tokens and
    logprobs must equal the eager PyTorch path: a padding row writing into a live block, or a wrong table or
    length, changes them (each padded step is followed by steps of the requests still running, which read the
    cache it wrote)."""
    prompts = _prompts([3, 11, 6, 13, 8])
    lengths = [6, 2, 4, 3, 5]  # after the prefill step: batch 5, 4, 3, 2 and 1 for one step each

    def run(kernels: str, **kw):  # noqa: ANN202
        # max_model_len 32 (the longest request needs 16): tables (32 + 128 tree room) / 4 = 40 blocks wide, not
        # the model's 96 (the interpreter runs each split of a padded table)
        engine = LLMEngine(ckpt, EngineConfig(kernels=kernels, block_size=4, max_model_len=32, **kw))
        reqs = [GenerationRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                                     logprobs=0))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
        return engine, engine.generate(reqs)

    _, want = run("torch")
    engine, got = run("triton", decode_graphs="emulate", decode_graph_buckets=(1, 2, 4, 8))
    _same(want, got)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.per_bucket == {8: 1, 4: 2, 2: 1, 1: 1}
    # every plain decode step went through the padded path: as many decode kernel calls as layers x replays
    assert calls["paged_decode_attention"] == 2 * sum(graphs.per_bucket.values())
    assert engine.model.k_caches[0].shape[0] == engine.block_manager.num_blocks + 1  # the scratch block


@needs_interpreter
def test_interpreter_decode_graphs_pad_into_their_own_block_and_leave_other_steps_eager(ckpt, calls) -> None:
    """decode_graphs = "emulate", one bucket of 2, a KV pool of 4 blocks, three waves. A lone 13-token prompt
    fills all 4 blocks (token 12 in slot 0 of the last one): its decode steps replay with a padding row that must
    write to the scratch block past the pool, not to the last block (token 12's K/V, read at every later step).
    A lone 2-token prompt's prefill (2 rows, one emitting) fits the bucket but is no decode, and a decode step of
    3 sequences fits no bucket: both must run eagerly (through the graph the prompt's rows would each attend as a
    decode over one cached token and the first row's logits would pick the token; the batch of 3 would raise).
    Tokens and logprobs must equal the eager PyTorch path, and only the two lone prompts' 4 decode steps replay."""
    waves = [(_prompts([13]), 3), (_prompts([2]), 3), (_prompts([1, 2, 3]), 2)]  # (prompts, max_tokens)

    def run(kernels: str, **kw):  # noqa: ANN202
        engine = LLMEngine(ckpt, EngineConfig(kernels=kernels, block_size=4, num_kv_blocks=4, max_model_len=32, **kw))
        return engine, [engine.generate([GenerationRequest(f"w{w}r{i}", tuple(p), SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)) for i, p in enumerate(ps)])
                        for w, (ps, n) in enumerate(waves)]

    _, want = run("torch")
    engine, got = run("triton", decode_graphs="emulate", decode_graph_buckets=(2,))
    for a, b in zip(want, got):
        _same(a, b)
    assert engine.runner.graphs.per_bucket == {2: 4}  # 2 + 2 padded decode steps; the batch of 3 never replays
