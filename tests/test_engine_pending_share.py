"""A prefix block shared before its K/V is written ("pending") is never read unwritten.

BlockManager.allocate lets a sequence reuse a full prefix block that a sequence admitted earlier in the SAME
step computes in that step's forward (the model writes every new token's K/V before any attention in each
layer); a block still being computed by a later chunk is not shared (DEFER). Why no public sequence of calls
reaches a sharer holding a block nobody writes (session 49's audit):

- `pending` lives for one `Scheduler.schedule()`, whose batch `LLMEngine.step()` runs at once: nothing between
  schedule and forward frees a sequence (preemption happens only while the running sequences are scheduled,
  before any admission; abort_request and update_weights are called between steps, by the replica's one
  thread). A step whose forward raises leaves a sharer counting unwritten blocks, but the replica process
  ends on it (replica.py) and the engine is not used again.
- a chunk cut by the step's token budget leaves no budget, so nothing is admitted after it: a sequence tried
  for admission never sees a registered block that this step's forward does not write.
- a sequence that leaves (finish, abort, preemption) unregisters its blocks without K/V and its partial tail.

These tests drive a real tiny engine through those states step by step through public calls only, and compare
every greedy completion (tokens and logprobs) with the same request run alone on an engine without prefix
sharing:

- a sharer takes the owner's pending blocks, then the owner is aborted (a client cancel);
- a sibling waits on an owner mid-way through a chunked prefill (queued, or deferred in the owner's last
  chunk), and the owner is aborted, or a policy weight push resets the prefix cache, before it finishes;
- n > 1 samples of one prompt with a KV pool so small that samples are preempted and recomputed in chunks,
  a second group sharing part of the prompt (and copying a partial tail) arriving meanwhile.

Spies on `allocate` and `schedule` check that each scenario really reached its state (a pending share, a
deferral, a preemption, a chunked recompute), so a rearranged scheduler cannot make a test pass vacuously.
"""

from __future__ import annotations

import random

import pytest
import safetensors.torch
import torch

from tlt.services.rollout.engine.block_manager import BlockManager
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint
from tlt.services.rollout.types import GenerationRequest, SamplingParams

BS = 4
MAX_NEW = 10
LOGPROB_TOL = 1e-5  # batched vs alone: CPU SDPA rounds a row by batch shape (measured <= 5e-7); unwritten K/V: ~0.1


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pending_share")
    shape = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=128, weight_scale=0.05)
    return random_checkpoint(root / "v0", seed=3, **shape), random_checkpoint(root / "v1", seed=4, **shape)


@pytest.fixture(scope="module")
def alone(ckpts):
    """alone(weights 0|1, prompt, max_tokens) -> (tokens, logprobs) of the prompt run by itself, no sharing."""
    engines = [LLMEngine(c, EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=1, prefix_sharing=False,
                                         max_num_batched_tokens=256, max_model_len=128)) for c in ckpts]
    memo: dict = {}

    def run(weights: int, prompt: tuple[int, ...], max_tokens: int = MAX_NEW):
        key = (weights, prompt, max_tokens)
        if key not in memo:
            (c,) = engines[weights].generate([GenerationRequest(f"alone{len(memo)}", prompt, greedy(max_tokens))])
            memo[key] = (c.token_ids, c.logprobs)
        return memo[key]

    return run


class Spy:
    """Wraps the engine's BlockManager.allocate and Scheduler.schedule: records deferrals, shares of blocks not yet
    computed, and recomputes of preempted sequences cut into chunks."""

    def __init__(self, engine: LLMEngine) -> None:
        self.bm = bm = engine.block_manager
        self.deferred: list[str] = []
        self.pending_shares: list[str] = []  # request ids that shared a block its owner computes this very step
        real = bm.allocate

        def allocate(seq, pending, copies=None):  # noqa: ANN001, ANN202
            got = real(seq, pending, copies)
            if got == BlockManager.DEFER:
                self.deferred.append(seq.request_id)
            elif got >= 0 and any(bm.blocks[b].ref_count > 1 and not bm.blocks[b].computed for b in seq.block_table):
                self.pending_shares.append(seq.request_id)
            return got

        bm.allocate = allocate
        self.chunked_recomputes = 0  # steps computing part, not all, of a preempted sequence's prompt + output
        sch, schedule = engine.scheduler, engine.scheduler.schedule

        def scheduled():  # noqa: ANN202
            batch = schedule()
            self.chunked_recomputes += sum(s.num_preemptions > 0 and n > 1 and s.num_computed + n < s.num_tokens
                                           for s, n in zip(batch.seqs, batch.num_new))
            return batch

        sch.schedule = scheduled


def engine_for(ckpt, **kw) -> LLMEngine:
    cfg = dict(block_size=BS, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128)
    return LLMEngine(ckpt, EngineConfig(**(cfg | kw)))


def finish(engine: LLMEngine, done: dict, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for c in engine.step()[1]:
            done[(c.request_id, c.sample_index)] = c
    assert not engine.has_unfinished(), "the engine stopped making progress (a sequence waits forever)"
    bm = engine.block_manager
    assert bm.num_free == bm.num_blocks, "blocks leaked"


def assert_alone(c, want) -> None:
    tokens, logprobs = want
    assert c.token_ids == tokens, (c.request_id, c.sample_index)
    assert max(abs(a - b) for a, b in zip(c.logprobs, logprobs)) <= LOGPROB_TOL, (c.logprobs, logprobs)


def rand_prompt(g: random.Random, n: int) -> list[int]:
    return [g.randrange(3, 250) for _ in range(n)]


def test_a_sharer_of_blocks_computed_in_its_step_is_exact_after_the_owner_is_aborted(ckpts, alone):
    g = random.Random(0)
    p = rand_prompt(g, 13)  # three full blocks and one token: both prompts share blocks 0-2
    engine = engine_for(ckpts[0])
    spy = Spy(engine)
    engine.add_request(GenerationRequest("owner", tuple(p + [7]), greedy()))
    engine.add_request(GenerationRequest("sharer", tuple(p + [8, 9]), greedy()))
    engine.step()  # owner: all 14 tokens (writes blocks 0-2); sharer: reuses them, computes 2 of its 3 tokens
    assert spy.pending_shares == ["sharer"]
    shared = engine._seqs["sharer"][0].block_table[:3]
    assert shared == engine._seqs["owner"][0].block_table[:3]
    engine.abort_request("owner")  # the owner leaves: the sharer alone holds blocks written by the owner
    assert all(engine.block_manager.blocks[b].ref_count == 1 for b in shared)
    engine.add_request(GenerationRequest("other", tuple(rand_prompt(g, 15)), greedy()))  # takes the freed blocks
    done: dict = {}
    finish(engine, done)
    assert_alone(done[("sharer", 0)], alone(0, tuple(p + [8, 9])))
    assert_alone(done[("other", 0)], alone(0, tuple(done[("other", 0)].prompt_token_ids)))
    assert "owner" not in {k[0] for k in done}


def uncomputed_registered(engine: LLMEngine) -> int:
    """Prefix blocks registered for sharing whose K/V a chunk has not written yet."""
    return sum(not b.computed for b in engine.block_manager.by_hash.values())


# 16-token budget, 39-token prompts sharing 38 tokens (9 full blocks, then a 2-token tail): the owner prefills
# in three chunks. The owner's chunk takes the whole budget until the last one, so the waiter is not even
# tried before step 3; in step 3 it is (budget left) and must wait (DEFER): blocks 8 and the tail are being
# written by the owner's chunk, which is not in `pending` (that holds only blocks of sequences admitted in the
# step). Aborting after steps 1 and 2 leaves blocks registered that nobody will compute.
STEPS = [(1, 4, 0), (2, 8, 0), (3, 9, 1)]  # steps before the abort / push, blocks computed by then, DEFERs


def owner_and_waiter(ckpt, seed: int, steps: int):  # noqa: ANN001, ANN201
    """The "owner" and "waiter" of STEPS (prompts of `seed`) added to a fresh engine, after `steps` steps."""
    p = rand_prompt(random.Random(seed), 38)
    engine = engine_for(ckpt)
    spy = Spy(engine)
    engine.add_request(GenerationRequest("owner", tuple(p + [7]), greedy()))
    engine.add_request(GenerationRequest("waiter", tuple(p + [8]), greedy()))
    for _ in range(steps):
        engine.step()
    return p, engine, spy


@pytest.mark.parametrize("steps, computed, defers", STEPS)
def test_a_sibling_waiting_on_a_chunked_prefill_is_exact_when_the_owner_is_aborted(ckpts, alone, steps, computed,
                                                                                  defers):
    p, engine, spy = owner_and_waiter(ckpts[0], 1, steps)
    assert spy.deferred.count("waiter") == defers and not engine._seqs["waiter"][0].block_table
    assert uncomputed_registered(engine) == 9 - computed
    engine.abort_request("owner")
    assert uncomputed_registered(engine) == 0
    done: dict = {}
    finish(engine, done)
    assert_alone(done[("waiter", 0)], alone(0, tuple(p + [8])))
    assert engine.block_manager.shared_hits == computed  # it reused exactly the blocks the owner had computed
    assert engine.block_manager.tail_copies == 0  # the owner's tail left with it


@pytest.mark.parametrize("steps, computed, defers", STEPS)
def test_a_sibling_waiting_across_a_weight_push_computes_under_the_new_weights(ckpts, alone, steps, computed, defers):
    p, engine, spy = owner_and_waiter(ckpts[0], 2, steps)
    assert spy.deferred.count("waiter") == defers and uncomputed_registered(engine) == 9 - computed
    engine.update_weights("policy", safetensors.torch.load_file(str(ckpts[1] / "model.safetensors")), 1)
    engine.add_request(GenerationRequest("after", tuple(p + [9]), greedy()))
    done: dict = {}
    finish(engine, done)
    # neither may reuse a block or tail of the owner's (v0 K/V, or v1 K/V computed over v0 context)
    assert_alone(done[("waiter", 0)], alone(1, tuple(p + [8])))
    assert_alone(done[("after", 0)], alone(1, tuple(p + [9])))
    assert done[("owner", 0)].versions.policy_min == 0  # the owner itself ran across the push, as designed


def test_n_samples_with_chunked_recompute_and_preemption_match_one_run_alone(ckpts, alone):
    g = random.Random(3)
    p = rand_prompt(g, 17)
    q = p[:9] + rand_prompt(g, 6)  # shares two full blocks with p; its samples copy a 2-token partial tail
    # a sample needs 10 blocks at its end, 16 hold the group only by preempting; recomputing a preempted
    # sample's prompt + output (up to 37 tokens) can take two chunks of the 20-token budget
    engine = engine_for(ckpts[0], num_kv_blocks=16, max_num_batched_tokens=20, max_num_seqs=6)
    spy = Spy(engine)
    engine.add_request(GenerationRequest("group", tuple(p), greedy(20), n=4))
    done: dict = {}
    for _ in range(3):
        for c in engine.step()[1]:
            done[(c.request_id, c.sample_index)] = c
    engine.add_request(GenerationRequest("group2", tuple(q), greedy(20), n=3))
    finish(engine, done)
    assert spy.pending_shares.count("group") >= 3  # the siblings reused blocks sample 0 wrote in their step
    assert engine.scheduler.num_preemptions >= 3 and spy.chunked_recomputes >= 1
    assert engine.block_manager.tail_copies >= 1
    for i in range(4):
        assert_alone(done[("group", i)], alone(0, tuple(p), 20))
    for i in range(3):
        assert_alone(done[("group2", i)], alone(0, tuple(q), 20))


def test_an_engine_whose_step_failed_refuses_to_step_again(ckpts) -> None:
    """A step whose forward raises after schedule() leaves the scheduler's and the block manager's state for a batch
    never computed (a sequence counting a shared prefix block as cached that nobody wrote): stepping on after, once
    the block's owner is aborted, read unwritten K/V (session 49: other tokens than the request run alone). The
    replica process ends on a failed step; an in-process caller that catches the error must not go on either: the
    engine refuses every later step, naming the first failure."""
    g = random.Random(0)
    prompt = [g.randrange(3, 250) for _ in range(13)]
    engine = LLMEngine(ckpts[0], EngineConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=8,
                                              max_num_batched_tokens=16, max_model_len=128))
    engine.add_request(GenerationRequest("owner", tuple(prompt + [7]), greedy()))
    engine.add_request(GenerationRequest("sharer", tuple(prompt + [8, 9]), greedy()))

    def boom(batch):
        raise RuntimeError("injected: forward failed")

    real, engine.runner.run = engine.runner.run, boom
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.runner.run = real
    engine.abort_request("owner")
    with pytest.raises(RuntimeError, match="an earlier step failed.*injected: forward failed"):
        engine.step()
    with pytest.raises(RuntimeError, match="an earlier step failed"):
        engine.step()
