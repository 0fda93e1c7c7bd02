"""The decode mirror (tlt/model/decode_mirror.py) changes no result: bitwise the gather path's hidden states.

Two native models with the same random weights run the same steps over their own paged caches: one
with the mirror, one with it switched off (`model.mirror = None`: every step gathers). With one SDPA
call over every slot (`max_parts = 1`) on one thread, every forward's hidden states must be bitwise
equal (with runs of slots attended apart, or on two threads, within the tolerance each test states),
through what makes the mirror append, compact, rebuild or stand aside: steady decode, finished rows (compacted into their slots), a reordering, a multi-token step,
`copy_slots`, a row swapped for another sequence at the same length, a context outgrowing the capacity,
a batch too big for it.
Then the engine: greedy tokens with and without the mirror under staggered finishes and preemption.
Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tlt.model import decode_mirror
from tlt.model.config import ModelConfig
from tlt.model.decode_mirror import GROW, MIN_BYTES
from tlt.model.loader import validate_tensors
from tlt.model.transformer import AttentionMetadata, build_model
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.types import GenerationRequest, SamplingParams

BS = 4


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise comparisons need one thread: with several, CPU SDPA rounds some rows differently by their position
    in the batch (1e-8 - 1e-7 at some shapes), and a compacted mirror holds rows in other positions than the
    gather path (`test_a_compacted_mirror_is_within_rounding_of_the_gather_path_on_two_threads`). Set per test:
    another test module may set the thread count when pytest imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pair(num_blocks: int):
    """(mirrored, gathering): native Qwen2 models with the same random weights, each with its own cache."""
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    hf_cfg.architectures = ["Qwen2ForCausalLM"]
    model = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    validate_tensors(cfg, tensors)
    pair = []
    for _ in range(2):
        m = build_model(cfg, tensors, max_len=512)
        m.allocate_kv_cache(num_blocks, BS)
        pair.append(m)
    pair[0].mirror.min_bytes = 0  # the test model is far below the size where the mirror pays off
    pair[0].mirror.max_parts = 1  # one SDPA call over slots in batch order: bitwise the gather path (split: below)
    pair[1].mirror = None
    return pair


class Harness:
    """Sequences with pre-drawn tokens and block tables; `step` runs both models and compares them."""

    def __init__(self, num_blocks: int) -> None:
        self.mirrored, self.gathering = _pair(num_blocks)
        self.free = list(range(num_blocks))
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.ctx: dict[str, int] = {}
        self.gen = torch.Generator().manual_seed(1)

    def add(self, name: str, prompt_len: int) -> None:
        self.tokens[name] = torch.randint(0, 97, (prompt_len + 300,), generator=self.gen).tolist()
        self.tables[name], self.ctx[name] = [], 0

    def step(self, names: list[str], q_lens: list[int] | None = None, atol: float = 0.0) -> str:
        """One forward of `names` (q_lens default 1 each) -> what the mirror did: append, rebuild or gather.
        Hidden states bitwise equal, or within `atol`."""
        q_lens = q_lens or [1] * len(names)
        ids, pos = [], []
        for n, q in zip(names, q_lens):
            c, table = self.ctx[n], self.tables[n]
            while len(table) * BS < c + q:
                table.append(self.free.pop(0))
            ids += self.tokens[n][c : c + q]
            pos += list(range(c, c + q))
        ctx = [self.ctx[n] for n in names]
        outs = []
        with torch.inference_mode():
            for m in (self.mirrored, self.gathering):
                meta = AttentionMetadata.build(q_lens, ctx, [self.tables[n] for n in names], BS)
                outs.append(m(torch.tensor(ids), torch.tensor(pos), meta))
        if atol:
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=atol)
        else:
            assert torch.equal(outs[0], outs[1])
        for n, q in zip(names, q_lens):
            self.ctx[n] += q
        held = self.mirrored.mirror.held
        return "gather" if held is None else "append" if held.rebuild_index is None else "rebuild"

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        for m in (self.mirrored, self.gathering):
            m.copy_slots(torch.tensor(src), torch.tensor(dst))


def test_mirror_appends_on_plain_decode_and_rebuilds_whenever_the_cache_may_differ():
    """After another write (a prefill, a multi-token step, `copy_slots`) the first decode step gathers and the next
    rebuilds; a batch that changed without another write (a finish, a reordering) rebuilds at once."""
    h = Harness(num_blocks=400)
    names = list("abcdef")
    for i, n in enumerate(names):
        h.add(n, 40 + 4 * i)
    assert h.step(names, [h.ctx[n] + 40 + 4 * i for i, n in enumerate(names)]) == "gather"  # prefill
    assert [h.step(names) for _ in range(4)] == ["gather", "rebuild", "append", "append"]
    names.remove("c")  # a sequence finished, as contexts reach the capacity (64): rebuilt for the capacity
    assert [h.step(names) for _ in range(2)] == ["rebuild", "append"]
    names = ["b", "a", *names[2:]]  # reordered
    assert [h.step(names) for _ in range(2)] == ["rebuild", "append"]
    assert h.step(names, [2] * len(names)) == "gather"  # a multi-token step (a chunk or a verify pass)
    assert [h.step(names) for _ in range(3)] == ["gather", "rebuild", "append"]
    a = h.tables["a"]  # overwrite a's newest K/V (speculative decoding keeping an accepted token)
    h.copy_slots([a[0] * BS], [a[(h.ctx["a"] - 1) // BS] * BS + (h.ctx["a"] - 1) % BS])
    assert [h.step(names) for _ in range(3)] == ["gather", "rebuild", "append"]
    # row b replaced by g, one token longer: the same row count, every context + 1, but other blocks
    h.add("g", h.ctx["b"] + 3)
    h.step(["g"], [h.ctx["b"] + 3])
    assert [h.step(names) for _ in range(3)] == ["gather", "rebuild", "append"]
    assert h.ctx["g"] == h.ctx["b"]
    assert h.step(["g" if n == "b" else n for n in names]) == "rebuild"


def test_finished_rows_are_compacted_into_their_slots_not_rebuilt():
    """Sequences finish, the rest keep their order: the rows past the new batch size move into the finished rows'
    slots and every step appends, bitwise the gather path's output, until a reordering rebuilds."""
    h = Harness(num_blocks=400)
    names = list("abcdefgh")
    for i, n in enumerate(names):
        h.add(n, 20 + 3 * i)
        h.step([n], [20 + 3 * i])
    assert [h.step(names) for _ in range(3)] == ["gather", "rebuild", "append"]
    mirror = h.mirrored.mirror
    for finished, slots in (("ca", [1, 3, 4, 5, 0, 2]), ("h", [1, 3, 4, 2, 0]), ("fb", [1, 2, 0])):
        names = [n for n in names if n not in finished]
        assert [h.step(names) for _ in range(2)] == ["append", "append"]
        assert mirror.held.slots == slots and mirror.views[0][0].shape[0] == len(names)
    names.remove("g")  # the last row finished: the others are already in slots 0 .. b - 1
    assert h.step(names) == "append" and mirror.held.slots == [1, 0]
    names.reverse()  # a reordering
    assert [h.step(names) for _ in range(2)] == ["rebuild", "append"] and mirror.held.slots is None


def test_a_compacted_mirror_is_within_rounding_of_the_gather_path_on_two_threads():
    """On two threads CPU SDPA rounds a row by its place in the batch, and the layers carry it on: within 1e-5 of
    outputs of magnitude ~1 (an AVX2 machine gave 1.07e-6, 9 float32 ulps, where an AVX-512 one stayed under 1e-6)."""
    torch.set_num_threads(2)
    h = Harness(num_blocks=400)
    names = list("abcdefgh")
    for i, n in enumerate(names):
        h.add(n, 20 + 3 * i)
        h.step([n], [20 + 3 * i], atol=1e-5)
    assert [h.step(names, atol=1e-5) for _ in range(3)] == ["gather", "rebuild", "append"]
    names = [n for n in names if n not in "ca"]
    assert [h.step(names, atol=1e-5) for _ in range(8)] == ["append"] * 8
    assert h.mirrored.mirror.held.slots is not None


def test_a_rebuild_sorts_the_slots_by_context_and_runs_of_slots_attend_apart():
    """With `max_parts` > 1 a rebuild puts the rows in slots sorted by context, and a step whose contexts differ
    enough attends runs of slots apart, each over its own longest context: within rounding of the gather path
    (other key counts per SDPA call), through appends, finishes and another rebuild."""
    h = Harness(num_blocks=2000)
    mirror = h.mirrored.mirror
    mirror.max_parts = 4
    names = [f"s{i}" for i in range(24)]
    lengths = [8 + (37 * i) % 180 for i in range(24)]  # 8 .. 185 tokens, not in order
    for n, length in zip(names, lengths):
        h.add(n, length)
        h.step([n], [length], atol=1e-5)
    assert [h.step(names, atol=1e-5) for _ in range(2)] == ["gather", "rebuild"]
    held = mirror.held
    assert [held.context_lens[r] for r in held.row_of_slot.tolist()] == sorted(held.context_lens)
    assert held.bounds is not None and len(held.bounds) > 2 and held.bounds[-1] == 24
    assert held.lks == [max(held.context_lens[r] for r in held.row_of_slot.tolist()[a:z]) + 1
                        for a, z in zip(held.bounds, held.bounds[1:])]
    assert [h.step(names, atol=1e-5) for _ in range(3)] == ["append"] * 3 and mirror.held.bounds is not None
    held = mirror.held  # the appends kept the runs, one key longer each: what choosing them afresh gives
    bounds, lks = held.bounds, held.lks
    assert (mirror._runs(held).bounds, held.lks) == (bounds, lks)
    assert lks == [max(held.context_lens[r] for r in held.row_of_slot.tolist()[a:z]) + 1
                   for a, z in zip(bounds, bounds[1:])]
    names = names[::3] + names[1::3]  # a reordering (s2, s5, ... finished): rebuilt, sorted again
    assert [h.step(names, atol=1e-5) for _ in range(2)] == ["rebuild", "append"]
    held = mirror.held
    assert [held.context_lens[r] for r in held.row_of_slot.tolist()] == sorted(held.context_lens)
    names = names[2:]  # finished: compacted
    assert [h.step(names, atol=1e-5) for _ in range(2)] == ["append", "append"]


def test_a_finish_with_another_row_changed_rebuilds():
    """Compaction needs every remaining row one token longer over the blocks it had, in the order it had: a row
    swapped for another sequence of the same length, or the remaining rows reordered, is anything else."""
    h = Harness(num_blocks=400)
    names = list("abcdef")
    for n in names:
        h.add(n, 30)
        h.step([n], [30])
    h.add("x", 34)
    h.step(["x"], [34])
    assert [h.step(names) for _ in range(4)] == ["gather", "rebuild", "append", "append"]
    assert h.ctx["x"] == h.ctx["b"]
    assert h.step(["a", "x", "d", "e", "f"]) == "rebuild"  # c finished and b swapped for x
    names = ["a", "x", "d", "e", "f"]
    assert h.step(names) == "append"
    assert h.step(["a", "x", "e", "d"]) == "rebuild"  # f finished, d and e swapped


def test_a_plain_step_alone_between_verify_passes_gathers_and_never_rebuilds():
    """Speculation's "plain" arm: one decode step between two multi-token (verify) passes. Rebuilding the mirror
    for it would copy every row's K/V into a mirror that the next verify pass invalidates, so it gathers; with
    `rebuild_after_other_writes` (the mirror's first form) it rebuilt every time. Bitwise the same hidden states."""
    h = Harness(num_blocks=400)
    names = list("abcdef")
    for n in names:
        h.add(n, 60)
        h.step([n], [60])
    assert [x for _ in range(4) for x in (h.step(names, [3] * len(names)), h.step(names))] == ["gather"] * 8
    h.mirrored.mirror.rebuild_after_other_writes = True
    assert [x for _ in range(2) for x in (h.step(names, [3] * len(names)), h.step(names))] == ["gather", "rebuild"] * 2


def test_a_context_outgrowing_the_capacity_rebuilds_once_per_grow():
    h = Harness(num_blocks=400)
    names = ["a", "b", "c", "d", "e"]
    for n in names:
        h.add(n, 60)
        h.step([n], [60])
    did = [h.step(names) for _ in range(GROW + 8)]  # contexts 60 .. 131: capacity 64, then 128, then 192
    assert did[:2] == ["gather", "rebuild"] and did.count("rebuild") == 3 and did.count("gather") == 1


def test_a_batch_too_big_for_the_mirror_gathers():
    """The mirror holds at most as many positions as the paged cache: one long and five short rows do not fit."""
    h = Harness(num_blocks=80)
    names = ["long", *"abcde"]
    h.add("long", 200)
    h.step(["long"], [200])
    for n in names[1:]:
        h.add(n, 10)
        h.step([n], [10])
    assert [h.step(names) for _ in range(3)] == ["gather"] * 3


def test_a_batch_under_min_bytes_gathers():
    """Below `MIN_BYTES` of K+V per layer (every batch of this test model) the gather path is the faster one."""
    h = Harness(num_blocks=400)
    h.mirrored.mirror.min_bytes = MIN_BYTES
    names = list("abcdef")
    for n in names:
        h.add(n, 60)
        h.step([n], [60])
    assert [h.step(names) for _ in range(3)] == ["gather"] * 3


def test_engine_greedy_tokens_are_the_same_with_and_without_the_mirror(tmp_path, monkeypatch):
    """Staggered finishes, new requests joining and preemption (a small cache): the same tokens, the mirror used.
    A run of slots costs nothing here (`SLOT_RUN_UNITS` = 0), so every step this small attends runs apart too."""
    monkeypatch.setattr(decode_mirror, "SLOT_RUN_UNITS", 0)
    ckpt = random_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, max_position_embeddings=256, seed=0, weight_scale=0.05)
    g = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(f"r{i}", tuple(torch.randint(3, 250, (int(n),), generator=g).tolist()),
                              SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True))
            for i, (n, m) in enumerate(zip(torch.randint(20, 60, (24,), generator=g),
                                           torch.randint(10, 70, (24,), generator=g)))]
    results, appends = [], []
    for mirror in (True, False):
        engine = LLMEngine(ckpt, EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, block_size=4,
                                              num_kv_blocks=200))
        if mirror:
            engine.model.mirror.min_bytes = 0
            assert engine.model.mirror.max_parts > 1  # runs of slots attended apart, as on any CPU engine
        else:
            engine.model.mirror = None
        for r in reqs:
            engine.add_request(r)
        done, n_append, n_moved, n_runs = {}, 0, 0, 0
        while engine.has_unfinished():
            for c in engine.step()[1]:
                done[c.request_id] = c.token_ids
            held = engine.model.mirror.held if mirror else None
            n_append += held is not None and held.rebuild_index is None
            n_moved += held is not None and held.slots is not None
            n_runs += held is not None and held.bounds is not None
        results.append(done)
        appends.append((n_append, n_moved, n_runs))
        assert engine.stats().num_preemptions > 0
    assert results[0] == results[1]
    # appended, with rows in other slots (sorted, or moved after finishes), and runs of slots attended apart
    assert appends[0][0] > 20 and appends[0][1] > 0 and appends[0][2] > 0
