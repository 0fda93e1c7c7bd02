"""Decode graph configuration (services/rollout/engine/decode_graphs.py), in-process.

The padded static-buffer decode itself runs on the Triton kernels, so its end-to-end check is
tests/test_engine_kernels.py::test_interpreter_decode_graph_buckets_emulated (a TRITON_INTERPRET=1
child process). Here: the bucket list and the errors a misconfiguration gets. CUDA graph capture
(decode_graphs = "cuda") needs a GPU and is not run here.
"""

from __future__ import annotations

import pytest

from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.decode_graphs import DecodeGraphs, default_buckets
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.engine.testing import random_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_checkpoint(tmp_path_factory.mktemp("graphs") / "m", hidden_size=32, intermediate_size=64,
                             num_layers=1, num_heads=2, num_kv_heads=1, max_position_embeddings=64, seed=0)


def test_default_buckets_double_up_to_the_largest_batch():
    assert default_buckets(1) == (1,)
    assert default_buckets(5) == (1, 2, 4, 5)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert default_buckets(128)[-3:] == (32, 64, 128)


def test_graphs_need_the_triton_path(ckpt):
    assert EngineConfig().decode_graphs == "off"
    with pytest.raises(ValueError, match="kernels = 'triton'"):
        EngineConfig(decode_graphs="emulate")  # auto = the PyTorch path on CPU: refused as the config is loaded
    with pytest.raises(ValueError, match="kernels = 'triton'"):  # and by the engine, for a config built unchecked
        LLMEngine(ckpt, EngineConfig.model_construct(decode_graphs="emulate"))


def test_bad_buckets_and_modes_are_refused(ckpt):
    model = LLMEngine(ckpt, EngineConfig()).model
    model.kernels = "triton"  # only the checks run: nothing is launched
    for buckets in ((), (4, 2), (0, 1)):
        with pytest.raises(ValueError, match="strictly increasing"):
            DecodeGraphs(model, 4, 8, 0, buckets, "emulate")
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(model, 4, 8, 0, (1, 2), "cuda")
    with pytest.raises(ValueError, match="'cuda' or 'emulate'"):
        DecodeGraphs(model, 4, 8, 0, (1, 2), "off")
    graphs = DecodeGraphs(model, 4, 8, 0, (1, 2, 4), "emulate")
    assert [graphs.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
