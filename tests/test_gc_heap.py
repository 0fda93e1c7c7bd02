"""The garbage collector in service processes (services/common/gc_heap.py).

A frozen object is freed by reference counting but never by the cycle collector, so a freeze after startup is
safe only if serving never turns startup objects into cyclic garbage: a weight push that replaced a module with
back-references, say, would leak the old one at every push. The second test serves in a child process (the
freeze must not touch pytest's own heap) whose heap was frozen after the engine started: requests with a learned
drafter, a policy push and a drafter push, then it counts the frozen objects that became unreachable.

Real parts: the native engine on a tiny random Qwen2 checkpoint, a learned drafter, real weight updates. That
`tlt rollout serve`'s front and replicas freeze their heaps, and what that does to pauses under load, is checked
by tests/test_rollout_load.py.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap

from rollout_helpers import tiny_checkpoint
from tlt.services.common.gc_heap import GcMetrics, GcPauses
from tlt.services.common.metrics import Metrics


def test_pauses_count_each_generation_while_installed():
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
        snap = pauses.snapshot()
        assert snap["collections"][0] >= 1 and snap["collections"][2] >= 1, snap
        assert snap["seconds"][2] > 0 and snap["max_seconds"][2] <= snap["seconds"][2], snap
        pauses.reset()
        assert pauses.snapshot()["collections"] == [0, 0, 0]
    finally:
        pauses.uninstall()
    gc.collect(2)
    assert pauses.snapshot()["collections"] == [0, 0, 0], "counted after uninstall"
    assert pauses._callback not in gc.callbacks


def test_a_snapshot_reports_the_frozen_count_without_walking_the_frozen_heap(monkeypatch):
    """`gc.get_freeze_count()` walks every frozen object (20-37 ms for a serving heap). A replica answered each
    status query (7 a second under `tlt run`) with a fresh count and its step loop stood still meanwhile. The count
    is taken once by freeze_heap; a snapshot must not call it. In-process: the freeze is undone before the end."""
    from tlt.services.common import gc_heap

    frozen = gc_heap.freeze_heap()
    try:
        # frozen objects freed by reference counting leave the permanent generation: the live count only falls
        assert 1000 < frozen and gc.get_freeze_count() <= frozen

        def walk() -> int:
            raise AssertionError("snapshot walked the permanent generation")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        assert GcPauses().snapshot()["frozen_objects"] == frozen == gc_heap.frozen_objects()
    finally:
        monkeypatch.undo()
        gc_heap.unfreeze_heap()
    assert gc.get_freeze_count() == 0 and GcPauses().snapshot()["frozen_objects"] == 0


def test_metrics_show_each_process_and_generation():
    m = Metrics("rollout")
    GcMetrics(m).update("replica-1", {"frozen_objects": 362_000, "collections": [40, 3, 1],
                                      "seconds": [0.01, 0.002, 0.2], "max_seconds": [0.001, 0.001, 0.2]})
    text = m.render().decode()
    assert 'rollout_gc_frozen_objects{process="replica-1"} 362000.0' in text
    assert 'rollout_gc_collections{generation="2",process="replica-1"} 1.0' in text
    assert 'rollout_gc_max_pause_seconds{generation="2",process="replica-1"} 0.2' in text


CHILD = textwrap.dedent("""
    import gc, json, sys
    import torch
    from tlt.model.drafter import Drafter, DrafterConfig
    from tlt.services.common.gc_heap import freeze_heap
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.spec.config import SpecConfig
    from tlt.services.rollout.types import GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(sys.argv[1], EngineConfig(block_size=8, max_model_len=128))
    drafter = Drafter(DrafterConfig.from_model_config(engine.model_config), engine.model.embed,
                      engine.model.lm_head).eval()
    engine.enable_spec(SpecConfig(mode="static", static_arm="4_1_5", threshold=64, hysteresis_steps=1,
                                  drafter="learned", drafter_path="(in memory)"), drafter)
    frozen = freeze_heap()
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1)
    prompts = [[5 + i, 9, 11 + i, 7] * 3 for i in range(4)]

    def serve(tag):
        return engine.generate([GenerationRequest(f"{tag}{i}", tuple(p), params, n=4) for i, p in enumerate(prompts)])

    serve("a")
    policy = {k: v.detach().clone() * 1.01 for k, v in engine.model.state_dict().items() if v.is_floating_point()}
    engine.update_weights("policy", policy, 1)
    engine.update_weights("drafter", {k: v.detach().clone() for k, v in drafter.state_dict().items()}, 2)
    out = serve("b")
    gc.collect()  # cyclic garbage made after the freeze: collectable, not a leak
    gc.unfreeze()
    leaked = gc.collect()  # what is left is garbage the freeze would have kept for ever
    print(json.dumps({"frozen": frozen, "leaked": leaked, "completions": len(out),
                      "verify_steps": engine.stats().spec["verify_steps"], "versions": [engine.versions.policy, engine.versions.drafter]}))
""")


def test_serving_after_the_freeze_leaves_no_frozen_garbage(tmp_path):
    model = tiny_checkpoint(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["frozen"] > 100_000, res  # torch, transformers and the engine: the heap a full collection walked
    assert res["completions"] == 16 and res["verify_steps"] > 0 and res["versions"] == [1, 2], res
    assert res["leaked"] == 0, f"serving made {res['leaked']} frozen objects into cyclic garbage"


def test_the_fronts_gc_metrics_start_once_it_serves_not_with_its_startup(tmp_path, monkeypatch):
    """/metrics' front collections are what serving costs (GcMetrics): the full collections the front ran while it
    started (loading the tokenizer and the replicas, here three forced ones) are not counted in them."""
    from rollout_helpers import ServerThread

    from tlt.services.rollout import server as rollout_server

    loaded = rollout_server._front_tokenizer

    def collecting(model_dir: str):  # noqa: ANN202 - the front's tokenizer, after three full collections
        for _ in range(3):
            gc.collect(2)
        return loaded(model_dir)

    monkeypatch.setattr(rollout_server, "_front_tokenizer", collecting)
    with ServerThread(tiny_checkpoint(tmp_path / "m"), replicas=1) as s:
        full = s.server.gc_pauses.snapshot()["collections"][2]
    assert full < 3, f"the front's {full} full collections include its startup's"
