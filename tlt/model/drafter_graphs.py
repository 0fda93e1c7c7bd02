"""ChainGraphs: the drafter's chain drafting replayed from CUDA graphs, one per batch bucket and chain shape.

A 12-draft chain is 12 drafter steps of some 30 small kernels each. On a GPU each launch costs host time, and
with the target's own steps replayed from graphs (`decode_graphs`, `verify_graphs`) the eager chain costs more
than the target step it saves (BENCHMARKS.md, "GPU (H200)": tail 0.77-0.90x with graphs, 2.6x eagerly). Here
`drafter_runtime.chain_draft` runs on static buffers padded to a batch bucket:

    h [bucket, H], cache rows, root positions  [bucket]   the chains' roots (their lengths read from the cache)
    params [bucket, 4], u [bucket, depth]                                   sampled chains only
    -> tokens [bucket, depth], cumulative log-probs [bucket, depth], draft distributions [bucket, depth, V]

with `span_cap` = the cache's capacity (every step attends over all of it, each row's keys past its own end
masked) and the filters given, so nothing reads the device from the host. With graphs on, the engine sizes the
cache for its whole context (up to `DRAFTER_CACHE_POSITIONS` = 2048, services/rollout/spec/decoder.py), so that a
rollout does not grow it and drop the graphs mid-run; a graphed step's attention therefore spans that capacity,
not the batch's longest sequence (for cpu-tiny's 1024-position context about 3x what a 350-token rollout's
dynamic chain attends: a deliberate trade, cheap for one drafter layer on a GPU). Past 2048 positions the cache
grows by doubling with the longest sequence drafted (`DrafterCache.ensure`). Padding rows draft into a scratch
cache row that no sequence owns. A graph is keyed by (bucket, depth, sampled, filter flags); all are dropped when
what they hold the addresses of changes (the cache or the rotary tables grown, the drafter's weights re-derived at
a hot-swap, the target's embedding or lm_head replaced) and captured again as used; `capture_all` captures what a
rollout will use up front.

Modes: "cuda" captures `torch.cuda.CUDAGraph`s; "emulate" runs the same padded static call eagerly, what the CPU
tests compare with the dynamic `DrafterRuntime.chain` (tests/test_drafter_graphs.py).

Status: "emulate" is tested on CPU; "cuda" passed its GPU test (tests/test_engine_cuda.py) on an H200 in session
32, after a fix: a capture after the graphs were dropped reused the released pool's handle. With graphs the
engine sizes the cache for its context (services/rollout/spec/decoder.py, DRAFTER_CACHE_POSITIONS), so that a
rollout rarely drops them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from tlt.model.drafter import DrafterCache
from tlt.model.drafter_runtime import DrafterRuntime

GraphMode = Literal["cuda", "emulate"]


class ChainGraphs:
    def __init__(self, runtime: DrafterRuntime, cache: DrafterCache, scratch_row: int, buckets: tuple[int, ...],
                 mode: GraphMode) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"drafter graph mode must be 'cuda' or 'emulate', got {mode!r}")
        if mode == "cuda" and runtime.device.type != "cuda":
            raise ValueError(f"drafter_graphs = 'cuda' needs the drafter on a CUDA device, it is on {runtime.device}")
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"graph buckets must be strictly increasing and >= 1, got {list(buckets)}")
        self.runtime, self.cache, self.scratch, self.mode, self.buckets = runtime, cache, scratch_row, mode, buckets
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, dict[str, torch.Tensor], list[torch.Tensor]]] = {}
        self._generation: tuple = ()
        self._pool = None
        self.depths: tuple[int, ...] = ()  # what `capture_all` captured for (again after a hot-swap)
        self.kinds: tuple[bool, ...] = ()  # ... greedy (False) and / or sampled (True)
        self.replays = 0
        self.captures = 0

    def bucket_for(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def _current_generation(self) -> tuple:
        """What the graphs hold the addresses of: the cache, the rotary tables, the fused weights (`refresh`
        makes new ones at every drafter hot-swap) and the target's embedding and lm_head."""
        c, r = self.cache, self.runtime
        return (c.k.data_ptr(), c.v.data_ptr(), c.lengths.data_ptr(), c.capacity, r._cos.data_ptr(), r._sin.data_ptr(),
                r._cos.shape[0], r.weights_version, r.drafter.embed.data_ptr(), r.drafter.lm_head.data_ptr())

    def _inputs(self, b: int, depth: int, sampled: bool) -> dict[str, torch.Tensor]:
        dev, hdim = self.runtime.device, self.runtime.drafter.cfg.hidden_size
        return {"h": torch.zeros(b, hdim, dtype=self.runtime.dtype, device=dev),
                "rows": torch.full((b,), self.scratch, dtype=torch.long, device=dev),
                "root_pos": torch.zeros(b, dtype=torch.long, device=dev),
                "params": torch.tensor([[1.0, 0.0, 1.0, 0.0]] * b, device=dev) if sampled else None,
                "u": torch.full((b, depth), 0.5, device=dev) if sampled else None}

    def _call(self, x: dict[str, torch.Tensor], depth: int, flags: int) -> list[torch.Tensor]:
        """The chain on the static buffers `x` (what a graph records); the rows' lengths are read in it."""
        c = self.cache
        return self.runtime.chain_call(x["h"], c, x["rows"], c.lengths[x["rows"]], x["root_pos"], depth,
                                       float("-inf"), x["params"], x["u"], c.capacity, flags)

    def _capture(self, key: tuple, b: int, depth: int, sampled: bool, flags: int) -> None:
        x = self._inputs(b, depth, sampled)
        graph = None
        if self.mode == "cuda":
            side = torch.cuda.Stream(device=self.runtime.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside capture: kernels chosen, allocator primed
                for _ in range(2):
                    self._call(x, depth, flags)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._call(x, depth, flags)
        else:
            out = []
        self.graphs[key] = (graph, x, out)
        self.captures += 1

    def _sync_generation(self) -> None:
        generation = self._current_generation()
        if generation != self._generation:  # reallocated: every graph holds the old addresses
            self.graphs.clear()
            # with its graphs gone the private pool is released: capturing into its handle again trips the
            # caching allocator's assert (`use_count > 0`, first seen on an H200 in session 32); a new pool
            self._pool = None
            self._generation = generation

    @torch.inference_mode()
    def capture_all(self, depths: tuple[int, ...], greedy: bool = True, sampled: bool = True) -> None:
        """Capture now, for every bucket and chain depth, greedy and / or sampled without filters: what RL rollouts
        draft, so that no capture lands inside a rollout until the cache grows (a request with top_k / top_p /
        min_p captures its own on first use)."""
        self.depths, self.kinds = depths, tuple(k for k, on in ((False, greedy), (True, sampled)) if on)
        self._sync_generation()
        for b in reversed(self.buckets):  # largest first, as decode_graphs.py: smaller ones reuse the pool
            for depth in depths:
                for sampled in self.kinds:
                    if (b, depth, sampled, 0) not in self.graphs:
                        self._capture((b, depth, sampled, 0), b, depth, sampled, 0)

    @staticmethod
    def filter_flags(filters: Iterable[tuple[float, float, float]]) -> int:
        """The `filter_flags` of rows with these (top_k, top_p, min_p), from the host's copy of the sampling params
        (a graph may not read them on the device): bit 0 some row has top_k or top_p, bit 1 some row has min_p.
        `chain_draft` computes the same predicate on the device when it is not given; the emulated graphs' test
        (tests/test_drafter_graphs.py) drafts with these flags and with that predicate and requires the same drafts."""
        filtered = min_p = False
        for top_k, top_p, mp in filters:
            filtered |= top_k > 0 or top_p < 1.0
            min_p |= mp > 0
        return int(filtered) | 2 * int(min_p)

    @torch.inference_mode()
    def chain(self, h: torch.Tensor, rows: torch.Tensor, root_pos: torch.Tensor, depth: int,
              params: torch.Tensor | None = None, u: torch.Tensor | None = None, filter_flags: int = 0,
              need: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """`DrafterRuntime.chain` (no confidence cut) for len(h) rows through the bucket's graph, or None when
        the batch is larger than every bucket (the caller drafts eagerly). filter_flags: see `chain_draft`.
        need: a bound the caller knows on every row's cached length + depth and root position + depth, which
        the cache and the rotary tables must already cover (a write past the cache would be an out-of-bounds
        device write inside a graph)."""
        n = h.shape[0]
        b = self.bucket_for(n)
        if b is None:
            return None
        if need > self.cache.capacity or need > self.runtime._cos.shape[0]:
            raise ValueError(f"a chain needing {need} positions on a drafter cache of {self.cache.capacity} and "
                             f"rotary tables of {self.runtime._cos.shape[0]}: grow them first")
        self._sync_generation()
        sampled = u is not None
        key = (b, depth, sampled, filter_flags if sampled else 0)
        if key not in self.graphs:
            self._capture(key, b, depth, sampled, key[3])
        graph, x, out = self.graphs[key]
        # padding rows keep what a larger batch left in h, root_pos, params and u (valid values, discarded
        # outputs) but must draft into the scratch row, not a real row named there last time
        x["h"][:n].copy_(h)
        x["rows"][:n].copy_(rows)
        x["rows"][n:] = self.scratch
        x["root_pos"][:n].copy_(root_pos)
        if sampled:
            assert params is not None and u is not None
            x["params"][:n].copy_(params)
            x["u"][:n].copy_(u)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            out = self._call(x, depth, key[3])
        toks, scores, probs = out
        return toks[:n].clone(), scores[:n].clone(), (probs[:n].clone() if sampled else None)
