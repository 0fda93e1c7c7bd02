"""`layer_ops.cpu_scripted`: the engine's layer and drafter functions run scripted on CPU tensors only, and their
GPU calls exclude cuDNN's SDPA.

On an H200 (session 30) a speculative run spent 86% of its time in cuDNN's attention, which builds a plan for
every new input shape (25 ms a call; the drafter's context grows every step). Nothing is faked: a `meta` tensor
stands for a non-CPU device.
"""

from __future__ import annotations

import torch

from tlt.model import drafter_runtime, layer_ops
from tlt.model.layer_ops import cpu_scripted, gpu_sdpa


def _scripting(x: torch.Tensor) -> bool:
    return torch.jit.is_scripting()


def test_cpu_tensors_take_the_scripted_function_and_others_the_python_one():
    f = cpu_scripted(_scripting)
    assert isinstance(f.scripted, torch.jit.ScriptFunction)
    assert f(torch.zeros(2)) is True
    assert f(torch.zeros(2, device="meta")) is False
    assert f.__name__ == "_scripting"
    assert f.for_tensor(torch.zeros(1)) is f.scripted and f.for_tensor(torch.zeros(1, device="meta")) is f.python


def _cudnn_sdpa_enabled(x: torch.Tensor) -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled()


def test_gpu_calls_of_attention_functions_exclude_cudnn_sdpa():
    f = cpu_scripted(_cudnn_sdpa_enabled, sdpa=True)  # TorchScript cannot script the flag's read: Python both ways
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert f(torch.zeros(1, device="meta")) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call
    assert f(torch.zeros(1)) is True  # a CPU call leaves the backends alone
    assert cpu_scripted(_cudnn_sdpa_enabled)(torch.zeros(1, device="meta")) is True  # without sdpa, as well


def test_gpu_sdpa_context_excludes_cudnn_off_the_cpu_only():
    with gpu_sdpa(torch.zeros(1, device="meta")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with gpu_sdpa(torch.zeros(1)):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_every_engine_function_is_wrapped():
    wrapped = [layer_ops.pre_attention_fn, layer_ops.post_attention_fn, layer_ops.group_attention_fn,
               layer_ops.dense_attention_fn, drafter_runtime.drafter_layer_fn, drafter_runtime.chain_draft_fn]
    for f in wrapped:
        assert isinstance(f, cpu_scripted), f
        assert f.sdpa == (f.__name__ not in ("pre_attention", "post_attention")), f"{f.__name__} calls SDPA"
        assert isinstance(f.scripted, torch.jit.ScriptFunction), f"{f.__name__} no longer scripts on CPU"
        assert not isinstance(f.python, torch.jit.ScriptFunction)
