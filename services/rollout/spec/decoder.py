"""SpecDecoder: one speculative decode step for a decode-only batch of the native engine.

    wants(batch)  -> SD on/off by batch size with hysteresis (switch.py)
    decode(seqs)  -> arm (bandit or static) -> draft trees (n-gram or EAGLE, drafting.py)
                  -> reserve KV slots for the nodes -> ONE target forward over all trees (tree masks
                     over the paged KV cache; with decode graphs on, replayed from the runner's
                     verify graph of the arm's shape, engine/verify_graphs.py; the drafter's own
                     passes stay eager) -> one target token per node (argmax, or one draw from
                     the filtered q with the counter uniform of the position the node's token takes,
                     rng.py: the draw plain decoding makes there) -> tree walk (accept.py);
                     chains SAMPLED from the drafter (`chain_sampling`, per sequence that samples):
                     rejection sampling min(1, q/p) against the filtered q instead (accept.py; exact in
                     distribution, but not seeded-identical to plain decoding: SpecConfig.chain_sampling;
                     a request with SamplingParams.reproducible always takes the tree walk)
                  -> copy the accepted nodes' K/V to their final slots -> SpecEmission per sequence

Each sequence in a decode batch has every token but its last in the KV cache (num_computed =
num_tokens - 1). The tree's root is that last token, at cache position c = num_computed; node i
is written at slot c + i with RoPE position c + depth_i. After acceptance the root and the accepted
nodes (path[1..a]) must sit at c .. c + a: copied there. num_computed becomes c + 1 + a; the emitted
bonus token is the new last token. The caller (the engine) appends the emitted tokens with its usual
per-token stop checks and stamps; tokens after a stop are dropped and the sequence finishes.
Returns None (the caller decodes plainly) when the KV cache has no room for the drafts, or when no
arm fits the verify-token budget at the batch size (adaptive; counted as `over_budget`).

Engine wiring (the engine owns it; `tests/test_spec_decoder.py::_spec_generate` does exactly this):

    batch = scheduler.schedule()
    if batch.copies:                              # partial prompt tails copied, not recomputed
        runner.copy_tails(batch.copies)
    if decoder is not None and decoder.wants(batch) and (em := decoder.decode(batch.seqs)) is not None:
        for seq, e in zip(batch.seqs, em):       # per token: append, version, logprob, feature row,
            ...                                  # check_stop; on a stop drop the rest and finish
        decoder.finish_step(step_start, kept)    # the bandit's reward: tokens kept / whole step time
    else:
        out = runner.run(batch); ...; emit       # plain step, then decoder.observe_plain(seqs, hidden)
        decoder.finish_step(step_start)          # rewards the "plain" arm when the bandit chose it (1 token each)
    on finish / abort / preemption: decoder.release(seq)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tlt.services.rollout.engine.block_manager import BlockManager
from tlt.services.rollout.engine.decode_graphs import default_buckets
from tlt.services.rollout.engine.model_runner import ModelRunner
from tlt.services.rollout.engine.scheduler import ScheduledBatch
from tlt.services.rollout.engine.sequence import Sequence
from tlt.services.rollout.engine.verify_graphs import plan_verify_graphs
from tlt.services.rollout.spec.accept import (
    AcceptResult,
    chain_accept_rejection,
    emitted_logprobs,
    node_targets,
    tree_accept,
)
from tlt.services.rollout.spec.bandit import BucketedEpsilonGreedy, PlainDebt, replica_seed
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.drafting import EagleSource, NgramSource
from tlt.services.rollout.spec.filters import filter_logits
from tlt.services.rollout.spec.rng import ACCEPT, PLAIN, RESIDUAL, counter_uniforms, key_tensor
from tlt.services.rollout.spec.switch import SpecSwitch
from tlt.services.rollout.spec.tree import Arm, DraftTree, ancestor_mask, is_chain


def _rejection(full: torch.Tensor, tree: DraftTree, filters: tuple[torch.Tensor, ...], keys: torch.Tensor,
               first: torch.Tensor, drafted: torch.Tensor | None = None) -> tuple[AcceptResult, torch.Tensor]:
    """Chains sampled from the drafter's p, verified by rejection sampling -> (result, node log q [B, N, V]).
    drafted [B] (None: every row all N - 1): the drafts each row kept through the confidence cut, whose
    draft_probs are then what the cut offered them from (`accept.cut_sampled_chain`).

    ACCEPT's counter uniform decides draft i (position c + 1 + i), RESIDUAL's draws the step's last token. The
    logprobs are log_softmax of the filtered logits, as plain sampling's: log of the softmax gave -inf wherever a
    probability underflowed (most alternatives at a low temperature)."""
    dev = full.device
    temps, top_k, top_p, min_p = (f[:, None] for f in filters)
    logq = filter_logits(full, temps, top_k, top_p, min_p).log_softmax(-1)
    s_len = tree.num_nodes - 1
    u = torch.cat([counter_uniforms(keys, first + torch.arange(s_len, device=dev), ACCEPT),
                   counter_uniforms(keys, first, RESIDUAL)], 1)
    res = chain_accept_rejection(tree.tokens[:, 1:].to(dev), tree.draft_probs.to(dev), logq.exp(), u=u,
                                 counts=None if drafted is None else drafted.to(dev))
    return res, logq  # the distribution each emitted token is distributed as


def _walk(full: torch.Tensor, tree: DraftTree, filters: tuple[torch.Tensor, ...], keys: torch.Tensor,
          first: torch.Tensor, drafted: torch.Tensor | None = None) -> tuple[AcceptResult, torch.Tensor]:
    """Deterministic drafts, verified by the tree walk with plain decoding's uniform at each position (cut and
    padding nodes hold token -1, which the walk never accepts: `drafted` is not needed; the parameter keeps
    `_rejection`'s signature for the mixed batch's dispatch)."""
    u = counter_uniforms(keys, first + tree.depth.to(full.device), PLAIN)
    nt = node_targets(full, *filters, u)
    return tree_accept(tree.tokens.to(full.device), tree.parents.to(full.device), nt.tokens), nt.logprobs


def _rows(tree: DraftTree, ix: torch.Tensor) -> DraftTree:
    """Rows `ix` (CPU indices) of a batch of trees."""
    probs = None if tree.draft_probs is None else tree.draft_probs[ix.to(tree.draft_probs.device)]
    return DraftTree(tree.tokens[ix], tree.parents[ix], tree.depth[ix], tree.score[ix], probs)


def _join(parts: list[tuple[torch.Tensor, AcceptResult, torch.Tensor]], b: int) -> tuple[AcceptResult, torch.Tensor]:
    """Per-row results of row subsets (CPU indices, result, node logprobs) -> one batch's, padded with -1."""
    width = max(r.tokens.shape[1] for _, r, _ in parts)
    ref, lp0 = parts[0][1], parts[0][2]
    dev = ref.tokens.device
    accept_len = ref.accept_len.new_zeros(b)
    tokens = ref.tokens.new_full((b, width), -1)
    path = ref.path.new_full((b, width), -1)
    logprobs = lp0.new_empty(b, *lp0.shape[1:])
    for ix, r, lp in parts:
        ix = ix.to(dev)
        w = r.tokens.shape[1]
        accept_len[ix], tokens[ix, :w], path[ix, :w], logprobs[ix] = r.accept_len, r.tokens, r.path, lp
    return AcceptResult(accept_len, tokens, path), logprobs


@dataclass
class SpecEmission:
    """Tokens one verify step emits for one sequence (accepted drafts, then the bonus)."""

    token_ids: list[int]
    logprobs: list[float]  # log q of each token under the sampling filters (raw log-softmax when greedy)
    # [len, H] target feature (post final norm) that produced each token; None when nothing reads it (the n-gram
    # source, no sequence collecting features for the drafter service)
    hidden: torch.Tensor | None
    top_logprobs: list[dict[int, float]] | None = None  # per token, the k best alternatives (params.logprobs = k > 0)


def build_spec_decoder(config: SpecConfig, runner: ModelRunner, block_manager: BlockManager,
                       drafter=None, max_seqs: int = 8, max_model_len: int = 0, replica: int = 0) -> SpecDecoder | None:
    """The engine's decoder for `config` (None when mode is off). A learned drafter is the one given or
    else loaded from `drafter_path` onto the target's device and dtype, sharing the target's embed/lm_head.
    replica: the rollout replica's index, which with config.seed seeds its bandit (`bandit.replica_seed`)."""
    if config.mode == "off":
        return None
    if config.drafter == "learned" and drafter is None:
        from tlt.model.drafter import load_drafter

        model = runner.model
        drafter = load_drafter(config.drafter_path, model.embed, model.lm_head)
        drafter = drafter.to(device=model.device, dtype=model.dtype).eval()
    return SpecDecoder(config, runner, block_manager, drafter, max_seqs, max_model_len, replica)


# The drafter cache starts with room for a whole sequence up to this many positions (and a row for every sequence
# that may speculate at once: `EagleSource`'s rows). Each growth copies the whole cache; with drafter graphs it also
# drops the graphs, which are captured again inside the rollout at tens of ms a capture (session 32, H200: the
# whole-rollout bench's batch 2-4 bucket at 0.65x when its first 320-token sequences grew the cache past the 256
# positions it started with); eagerly the growths were 2% of a learned CPU rollout (session 33). Longer contexts
# still grow by doubling. An eager chain attends over its rows' lengths; a graphed one over the whole capacity.
# Memory: rows x positions x 2 (K, V) x kv_heads x head_dim x dtype size, one layer: the cpu-tiny preset's 32 rows x
# 1036 positions in fp32 are 25 MB; 64 rows x 2048 positions of an 8 x 128-head drafter in bf16, 512 MB. The start
# size is capped at DRAFTER_CACHE_START_BYTES (fewer positions first, down to 256, then fewer rows, down to 8): a
# large max_num_seqs with a large threshold would otherwise allocate gigabytes up front, outside kv_cache_mb.
DRAFTER_CACHE_POSITIONS = 2048
DRAFTER_CACHE_START_BYTES = 1 << 30
DRAFTER_CACHE_MIN_POSITIONS, DRAFTER_CACHE_MIN_ROWS = 256, 8  # what the cap leaves at least


def drafter_cache_shape(drafter, used: tuple[Arm, ...], threshold: int, max_seqs: int,
                        max_model_len: int) -> tuple[int, int]:
    """(rows, positions) the learned drafter's cache starts with, for drafting with the arms `used`.

    Rows: a sequence holds one from its first draft until it ends, so more than the threshold's worth only when a
    batch grew past it and fell back while those still ran (the cache then adds rows): min(max_seqs, 2 x threshold).
    Positions: the context (0: unknown) plus the deepest write past a sequence's length (a chain's depth, a tree's
    (steps - 1) x topk expanded nodes), up to DRAFTER_CACHE_POSITIONS. Within DRAFTER_CACHE_START_BYTES."""
    rows, positions = min(max_seqs, 2 * threshold), DRAFTER_CACHE_MIN_POSITIONS
    if max_model_len > 0:
        ahead = max(a.steps if a.topk == 1 else max(a.steps, (a.steps - 1) * a.topk) for a in used)
        positions = max(positions, min(DRAFTER_CACHE_POSITIONS, max_model_len + ahead))
    cfg = drafter.cfg
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * next(drafter.parameters()).dtype.itemsize  # K and V
    if rows * positions * per_position > DRAFTER_CACHE_START_BYTES:  # it still grows past its start as used
        positions = max(DRAFTER_CACHE_MIN_POSITIONS, DRAFTER_CACHE_START_BYTES // (rows * per_position))
        rows = max(DRAFTER_CACHE_MIN_ROWS, min(rows, DRAFTER_CACHE_START_BYTES // (positions * per_position)))
    return rows, positions


class SpecDecoder:
    def __init__(self, config: SpecConfig, runner: ModelRunner, block_manager: BlockManager, drafter=None,
                 max_seqs: int = 8, max_model_len: int = 0, replica: int = 0) -> None:
        """max_seqs: the most sequences the engine runs at once (EngineConfig.max_num_seqs), which with the threshold
        sizes the drafter cache's rows (min(max_seqs, 2 x threshold)); max_model_len: the engine's context limit (0:
        unknown), which sizes its positions (DRAFTER_CACHE_POSITIONS, DRAFTER_CACHE_START_BYTES); replica: the
        rollout replica's index, which with config.seed seeds the bandit (`replica_seed`)."""
        self.config = config
        self.replica = replica
        self.runner = runner
        self.bm = block_manager
        self.switch = SpecSwitch(config.threshold, config.hysteresis_steps)
        self.static_arm = Arm.parse(config.static_arm)
        self.bandit = self.new_bandit()
        if config.drafter == "learned":
            if drafter is None:
                raise ValueError("SpecConfig.drafter = 'learned' needs a Drafter (tlt.model.drafter.load_drafter)")
            # the arms the rollouts will draft with
            used = (self.static_arm,) if config.mode == "static" else tuple(a for arms in config.arms() for a in arms)
            rows, capacity = drafter_cache_shape(drafter, used, config.threshold, max_seqs, max_model_len)
            self.source: NgramSource | EagleSource = EagleSource(
                drafter, capacity=capacity, chain_min_prob=config.chain_min_prob, graphs=config.drafter_graphs,
                graph_buckets=default_buckets(config.threshold), rows=rows)
            if self.source.graphs is not None:  # greedy chains only without the cut
                depths = {min(a.steps, a.draft_tokens - 1) for a in used if a.topk == 1 and not a.is_plain}
                self.source.graphs.capture_all(tuple(sorted(depths)), greedy=config.chain_min_prob == 0,
                                               sampled=config.chain_sampling)
        else:
            self.source = NgramSource(config.ngram_min, config.ngram_max)
        if runner.graphs is not None:  # decode graphs on: verify passes get per-arm graphs in the same mode
            runner.enable_verify_graphs(plan_verify_graphs(self._arms_at, config.threshold, runner.graphs.buckets))
        self.verify_steps = 0
        # engine steps that emitted tokens without speculation while attached (observe_plain): a prompt's last
        # prefill chunk is one, a chunk that emits nothing is not (the engine returns before; steps_run counts it)
        self.plain_steps = 0
        self.last_step_seconds = 0.0  # wall time of the last step the decoder chose the arm of (finish_step)
        self.seq_steps = 0
        self.emitted_tokens = 0
        self.drafted_tokens = 0
        self.last_arm: Arm | None = None
        self.no_room = 0
        self.over_budget = 0  # steps decoded plainly because no arm fit the verify-token budget
        self.kv_copies = 0  # accepted nodes whose K/V had to move (a branch other than the first was taken)
        self.arm_stats: dict[str, dict[str, int]] = {}  # per arm: verify_steps, seq_steps, emitted (tokens)
        # the last step's reward, until finish_step: (batch, arm, tokens, start, catch-up seconds to leave out)
        self._pending: tuple[int, Arm, int, float, float] | None = None
        # catch-up: before a verify step that follows a step without one (SD off, prefill, the "plain" arm,
        # no room), the drafter first takes in what those steps appended; timed apart (`finish_step`)
        self._behind = True
        # the "plain" arm steps (bandit.PlainDebt) the backlog is owed to when they alone built it
        # since the drafter was last up to date: the catch-up is charged to them (`_catch_up`); None: another step
        # without a verify added to it (SD off, a prefill, no arm within the budget, no KV room), no arm's choice
        self._owed: PlainDebt | None = None
        self.catch_ups = 0
        self.catch_up_seconds = 0.0
        self.catch_up_charged_seconds = 0.0  # the part charged to plain-arm steps' rewards

    # ---------------------------------------------------------------- control
    def wants(self, batch: ScheduledBatch) -> bool:
        """Call once per engine step with the scheduled batch: speculate in this step? A decode-only batch holds
        every running sequence (the scheduler admits a prompt only while budget is left after the decodes, so the
        running count never exceeds the token budget), so its size is the running batch the switch follows."""
        if self.config.mode == "off":
            return False
        decode = bool(batch.seqs) and batch.is_decode_only
        speculate = self.switch.update(len(batch.seqs), decode) and decode  # prefill steps do not count toward on
        if not speculate:  # the step decodes plainly: the drafter falls behind by its tokens, owed to no arm
            self._behind, self._owed = True, None
        return speculate

    def choose_arm(self, batch_size: int) -> Arm | None:
        """The step's arm; None: no bandit arm fits the verify-token budget at this batch size."""
        return self.static_arm if self.config.mode == "static" else self.bandit.choose(batch_size)

    # ---------------------------------------------------------------- the step
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[SpecEmission] | None:
        """One draft + verify step of `seqs`, or None: the engine decodes this step plainly (the arm is
        "plain", no arm fits the verify-token budget, or the KV cache has no room for the drafts) and
        then calls `finish_step` as after a verify step."""
        self.finish_step()  # a previous step's reward the caller did not close
        t0 = time.perf_counter()
        for s in seqs:
            if s.num_computed != s.num_tokens - 1:
                raise ValueError(f"{s} is not in decode state (num_computed must be num_tokens - 1)")
        arm = self.choose_arm(len(seqs))
        if arm is None:  # every arm is over the verify-token budget: decode plainly, nothing to reward
            self.over_budget += 1
            self._behind, self._owed = True, None
            return None
        if arm.is_plain:  # the bandit chose not to speculate: the engine decodes this step plainly
            self._pending = (len(seqs), arm, len(seqs), t0, 0.0)  # one token per sequence, rewarded in finish_step
            self._count_arm(arm, len(seqs))
            self.last_arm = arm
            self._behind = True
            return None
        catch_up = self._catch_up(seqs) if self._behind else 0.0
        if isinstance(self.source, EagleSource):  # sampled chains for the sequences that sample (see SpecConfig)
            sample = [self.config.chain_sampling and arm.topk == 1 and s.params.temperature > 0
                      and s.rng_key is not None and not s.params.reproducible for s in seqs]
            tree, counts = self.source.draft(seqs, arm, sample=sample)
        else:
            tree, counts = self.source.draft(seqs, arm)
        n_list = counts.tolist()
        ctx = [s.num_computed for s in seqs]
        valid = torch.arange(tree.num_nodes)[None, :] < counts[:, None]  # [B, N] real (non-padding) nodes
        deepest = torch.tensor(ctx) + tree.depth.masked_fill(~valid, 0).amax(1)
        if int(deepest.max()) >= self.runner.model.cos.shape[0] or not self._reserve(seqs, n_list):
            self.no_room += 1  # drafts would pass the context limit, or no KV blocks for them
            if self.config.mode != "static":
                self.bandit.withdraw()  # the arm did not run: its chosen count is of steps it ran
            self._behind, self._owed = True, None
            return None
        dev = self.runner.device
        b, n_max = tree.tokens.shape
        equal = all(n == n_max for n in n_list)  # no padding nodes
        hidden = self._verify_forward(arm, tree, n_list, valid, ctx, seqs)
        logits = self.runner.model.compute_logits(hidden).float()
        if equal:  # the flat rows are [B, N] already
            full, hid = logits.view(b, n_max, -1), hidden.view(b, n_max, -1)
        else:
            valid_d = valid.to(dev)
            full = logits.new_zeros(b, n_max, logits.shape[-1])
            full[valid_d] = logits
            hid = hidden.new_zeros(b, n_max, hidden.shape[-1])
            hid[valid_d] = hidden
        p = [s.params for s in seqs]
        temps = torch.tensor([x.temperature for x in p], device=dev)
        top_k, top_p = torch.tensor([x.top_k for x in p], device=dev), torch.tensor([x.top_p for x in p], device=dev)
        min_p = torch.tensor([x.min_p for x in p], device=dev)
        # counter uniforms (rng.py): the root's child is the token at position c + 1, a node at depth d
        # decides position c + 1 + d; greedy rows (no key) take key 0 and never use theirs
        keys = key_tensor([s.rng_key or 0 for s in seqs], dev)
        first = torch.tensor(ctx, device=dev)[:, None] + 1
        # rows whose drafts were sampled from p: rejection sampling against the filtered q; the others: the tree walk
        rej = None if tree.draft_probs is None else (tree.sampled if tree.sampled is not None
                                                     else torch.ones(b, dtype=torch.bool))
        filters = (temps, top_k, top_p, min_p)
        drafted = None if equal else counts - 1  # rows the confidence cut (or padding) left short
        if rej is None or not bool(rej.any()):
            res, node_logprobs = _walk(full, tree, filters, keys, first)
        elif bool(rej.all()):
            res, node_logprobs = _rejection(full, tree, filters, keys, first, drafted)
        else:  # a batch of both (a greedy or a cold neighbour): each row as it would be alone
            ri, wi = rej.nonzero().squeeze(1), (~rej).nonzero().squeeze(1)
            parts = [(ix, *fn(full[ix.to(dev)], _rows(tree, ix), tuple(f[ix.to(dev)] for f in filters),
                              keys[ix.to(dev)], first[ix.to(dev)], None if drafted is None else drafted[ix]))
                     for ix, fn in ((ri, _rejection), (wi, _walk))]
            res, node_logprobs = _join(parts, b)
        lps = emitted_logprobs(res, node_logprobs).cpu()
        res = AcceptResult(res.accept_len.cpu(), res.tokens.cpu(), res.path.cpu())  # hid stays on the device
        src, dst, out = [], [], []
        accept, paths, tokens, token_lps = res.accept_len.tolist(), res.path.tolist(), res.tokens.tolist(), lps.tolist()
        # every row's accepted features in one gather (a gather per row was B kernel launches a step on a GPU), when
        # something reads them: the learned drafter, or a sequence collecting features for the drafter service
        lens = [a + 1 for a in accept]
        features: tuple[torch.Tensor | None, ...] = (None,) * b
        if isinstance(self.source, EagleSource) or any(s.features is not None for s in seqs):
            at = torch.tensor([i * n_max + k for i, n in enumerate(lens) for k in paths[i][:n]], device=dev)
            features = hid.reshape(b * n_max, -1).index_select(0, at).split(lens)
        for i, s in enumerate(seqs):
            a = accept[i]
            path = paths[i][: a + 1]
            for k in range(1, a + 1):
                if path[k] != k:
                    src.append(self.runner.slot(s, ctx[i] + path[k]))
                    dst.append(self.runner.slot(s, ctx[i] + k))
            s.num_computed = ctx[i] + 1 + a
            tops = None
            k_top = s.params.logprobs or 0
            if k_top > 0:  # alternatives from the same distribution each token was drawn from
                vals, ids = node_logprobs[i, path].topk(k_top, dim=-1)
                tops = [dict(zip(r_ids, r_vals)) for r_ids, r_vals in zip(ids.tolist(), vals.tolist())]
            out.append(SpecEmission(tokens[i][: a + 1], token_lps[i][: a + 1], features[i], tops))
        if src:
            self.kv_copies += len(src)
            self.runner.copy_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        self.source.observe(seqs, [e.token_ids for e in out],
                            [list(e.hidden) if e.hidden is not None else [] for e in out], [c + 1 for c in ctx])
        emitted = sum(len(e.token_ids) for e in out)
        self.verify_steps += 1
        self.seq_steps += len(seqs)
        self.drafted_tokens += int(counts.sum()) - len(seqs)
        self.last_arm = arm
        self._count_arm(arm, len(seqs))
        # timed, counted in the accept lengths and (adaptive) rewarded in finish_step, with the tokens a stop leaves
        self._pending = (len(seqs), arm, emitted, t0, catch_up)
        self._behind = False
        if self._owed is None:  # up to date: what plain-arm steps leave behind from here is theirs
            self._owed = PlainDebt(self.bandit)
        return out

    def _catch_up(self, seqs: list[Sequence]) -> float:
        """Bring the drafter up to date with what steps without a verify appended (a learned drafter's
        buffered pairs: up to `EagleSource.max_pending` per sequence after SD was off). Returns its seconds,
        which `finish_step` leaves out of the arm's reward: the backlog is owed to the steps that built it,
        not to the arm that happens to run next (it would lower that arm's median after every switch-on).
        When "plain" arm steps alone built it (since the last verify step), those steps chose it: the seconds
        are added to their step times, shared by their tokens, and their rewards amended (`bandit.PlainDebt`);
        left out, not speculating looked cheaper than it is. A backlog another step added to (SD off, a
        prefill, no arm within the budget, no KV room) stays out of every reward."""
        c0 = time.perf_counter()
        self.source.catch_up(seqs)
        seconds = time.perf_counter() - c0
        self.catch_ups += 1
        self.catch_up_seconds += seconds
        if self._owed is not None:
            self.catch_up_charged_seconds += self._owed.charge(seconds)
        return seconds

    def _verify_forward(self, arm: Arm, tree: DraftTree, n_list: list[int], valid: torch.Tensor, ctx: list[int],
                        seqs: list[Sequence]) -> torch.Tensor:
        """The target's forward over every tree's real nodes -> hidden [sum(n_list), H], tree by tree.
        Through the runner's verify graph of the arm's shape when it has one for this batch (padded
        static buffers, `VerifyGraphs`), else eagerly over exactly the real nodes (`ModelRunner.extend`)."""
        tables = [s.block_table for s in seqs]
        graphs = self.runner.verify_graphs
        if graphs is not None and graphs.fits(arm, ctx):
            return graphs.run(arm, tree.tokens, tree.depth, ancestor_mask(tree.parents), n_list, ctx, tables)
        dev = self.runner.device
        if all(n == tree.num_nodes for n in n_list) and is_chain(tree.parents) and not self.runner.for_kernels:
            tree_masks = None  # the default causal mask among new tokens is the chains' tree mask (SDPA path)
        else:
            masks = ancestor_mask(tree.parents)  # padding nodes (past each count) are sliced away below
            tree_masks = [masks[i, :n, :n] for i, n in enumerate(n_list)]
        ids = tree.tokens[valid].to(dev)
        positions = (torch.tensor(ctx)[:, None] + tree.depth)[valid].to(dev)
        return self.runner.extend(ids, positions, n_list, ctx, tables, tree_masks)  # CPU: the metadata is built there

    def _arms_at(self, batch_size: int) -> tuple[Arm, ...]:
        """The arms `choose_arm` may return at this batch size (what the verify graph plan covers)."""
        if self.config.mode == "off":
            return ()
        return (self.static_arm,) if self.config.mode == "static" else self.bandit.eligible(batch_size)

    def _count_arm(self, arm: Arm, seqs: int) -> None:
        a_st = self.arm_stats.setdefault(arm.name, {"verify_steps": 0, "seq_steps": 0, "emitted": 0})
        a_st["verify_steps"] += 1  # steps run with the arm (for "plain": steps the bandit chose not to speculate)
        a_st["seq_steps"] += seqs  # its tokens: finish_step
    def finish_step(self, step_start: float | None = None, kept: int | None = None) -> None:
        """The engine step that ran `decode` is over (its tokens emitted): reward the arm with its tokens
        per second of the WHOLE step since `step_start` (scheduling and emission included, TLT.md section
        5: "step wall time"), not only the decode call's, which would favour short arms that need more
        steps. Without a step start (a caller that drives `decode` itself) the decode call's time.

        `kept`: the tokens the engine appended in the step. A stop (eos, max_tokens, a stop string) drops
        the rest of an accepted path, and those tokens are no throughput: counting them would reward
        deep arms for drafts past the end of finishing sequences, which is most of the small-batch steps
        at the end of a rollout. Without it, the tokens `decode` emitted.

        The step's drafter catch-up (`_catch_up`) is left out of the reward (charged to the plain-arm steps
        that left it, if they alone did); `last_step_seconds` (the whole step) and `catch_up_seconds` still
        show it."""
        if self._pending is None:
            return
        batch, arm, emitted, t0, catch_up = self._pending
        if kept is not None:  # what a stop dropped is out of the accept-length counts too (counted at decode, they
            emitted = kept  # read 32 tokens over 12 verify steps where 30 were kept)
        self.arm_stats[arm.name]["emitted"] += emitted
        if not arm.is_plain:
            self.emitted_tokens += emitted
        self._pending = None
        self.last_step_seconds = time.perf_counter() - (t0 if step_start is None else step_start)
        if self.config.mode == "adaptive":
            seconds = self.last_step_seconds - catch_up
            self.bandit.record(batch, arm, emitted, seconds)
            if arm.is_plain and self._owed is not None:  # the drafter falls behind by its tokens: `_catch_up`
                self._owed.add(batch, arm, emitted, seconds, self.bandit.last_slot)

    def _reserve(self, seqs: list[Sequence], n_nodes: list[int]) -> bool:
        """Give each sequence KV slots for its tree nodes (c .. c + n - 1); False if blocks run out, or if a
        sequence's block table would outgrow the runner's width (max_model_len + 128 positions: fixed under verify
        CUDA graphs), which a tree of more than 128 nodes near the context limit did."""
        bs = self.bm.block_size
        need = [max(0, self.bm.blocks_needed(s.num_computed + n) - len(s.block_table)) for s, n in zip(seqs, n_nodes)]
        if sum(need) > self.bm.num_free:
            return False
        width = self.runner.max_blocks_per_seq
        if width and any(len(s.block_table) + k > width for s, k in zip(seqs, need)):
            return False
        for s, k in zip(seqs, need):
            for _ in range(k):
                s.block_table.append(self.bm._take_free().id)  # extra blocks stay with the sequence as it grows
        assert all(len(s.block_table) * bs >= s.num_computed + n for s, n in zip(seqs, n_nodes))
        return True

    def observe_plain(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """After a plain decode/prefill step appended one token to each of `seqs`: hidden [B, H] is the
        target feature that produced it. Keeps the learned drafter warm while SD is off, so switching
        on needs neither a target re-prefill nor a cold step (only pairs are buffered, at most
        `EagleSource.max_pending` per sequence, and only while the batch is within 4x the threshold)."""
        self.plain_steps += 1
        if not isinstance(self.source, EagleSource) or self.config.mode == "off":
            return
        if len(seqs) > 4 * self.config.threshold:
            return  # far from the tail: buffering would only hold memory (rows restart from later pairs)
        live = [i for i, s in enumerate(seqs) if not s.is_finished]  # finished ones were released
        # one copy of the step's features (the runner may reuse its output buffer), rows as views of it:
        # a row keeps the [B, H] copy alive while it is pending, no more memory than B row copies
        rows = hidden.detach().clone().unbind(0)
        self.source.observe([seqs[i] for i in live], [[seqs[i].token_ids[-1]] for i in live],
                            [[rows[i]] for i in live], [seqs[i].num_tokens - 1 for i in live])

    # ---------------------------------------------------------------- lifecycle
    def release(self, seq: Sequence) -> None:
        """A sequence finished or was preempted: drop its drafting state."""
        self.source.release(seq)

    def forget(self, request_id: str) -> None:
        """A request is over (all its sequences finished, or it was aborted): drop what was kept for it."""
        self.source.forget(request_id)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        if not isinstance(self.source, EagleSource):
            raise ValueError("this engine drafts with n-grams (spec drafter = 'ngram'); it has no drafter weights to update")
        self.source.drafter.load_tensors(tensors)  # validates everything before copying
        self.source.reset()
        self._owed = None  # the backlog went with the rows: no catch-up of it to charge
        self.bandit.drafter_changed(self.config.rewards_kept_on_swap)  # the old drafter's rewards no longer hold

    def new_bandit(self) -> BucketedEpsilonGreedy:
        """A cold bandit of this decoder's config (no rewards held), on this replica's random stream."""
        c = self.config
        return BucketedEpsilonGreedy(c.bucket_thresholds, c.arms(), c.epsilon, c.window, c.verify_token_budget or None,
                                     replica_seed(c.seed, self.replica), c.exact_sizes)

    def stats(self) -> dict:
        return {
            "mode": self.config.mode,
            "on": self.switch.on,
            "switches": self.switch.switches,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "last_step_seconds": self.last_step_seconds,
            "emitted_tokens": self.emitted_tokens,
            "seq_steps": self.seq_steps,  # sequences over all verify steps
            "mean_accept_len": self.emitted_tokens / max(1, self.seq_steps),  # tokens per sequence per verify
            "drafted_tokens": self.drafted_tokens,
            "last_arm": None if self.last_arm is None else self.last_arm.name,
            "no_room": self.no_room,
            "over_budget": self.over_budget,  # steps decoded plainly: no arm fit the verify-token budget
            "kv_copies": self.kv_copies,
            "cold_starts": getattr(self.source, "cold_starts", 0),
            "catch_ups": self.catch_ups,  # verify steps that first caught the drafter up (after steps without SD)
            "catch_up_seconds": self.catch_up_seconds,  # their total catch-up time, in no verify arm's reward
            "catch_up_charged_seconds": self.catch_up_charged_seconds,  # of which charged to plain-arm steps
            # per arm: verify steps chosen, sequence-steps, tokens emitted (accept length = emitted / seq_steps)
            "arms": {k: dict(v) for k, v in self.arm_stats.items()},
            # adaptive: per bandit bucket, how often it explored / exploited and each arm's data
            "bandit": [] if self.config.mode != "adaptive" else [
                {"bucket": b.label, "explored": b.explored, "exploited": b.exploited, "over_budget": b.over_budget,
                 "arms": [{"arm": a.arm, "samples": a.samples, "median_reward": a.median_reward, "chosen": a.chosen}
                          for a in b.arms]}
                for b in self.bandit.snapshot()],
        }
