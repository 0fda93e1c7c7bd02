"""Process-group set-up for the policy trainer.

Under the DeepSpeed launcher (`deepspeed --hostfile ... -m tlt.cli train`)
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are already set and we only call
`deepspeed.init_distributed`. Started plainly (`tlt train`, tests), we are a
world of one: a TCP rendezvous on loopback at a free port chosen here, given
to init_distributed directly (only LOCAL_RANK=0 goes into the environment). Backend: NCCL on
GPU, gloo on CPU.

DeepSpeed probes and JIT-compiles C++ ops on first use (on CPU its
shared-memory all-reduce is built when the process group starts: about a
minute of compiling, and a failing `-laio` link probe). The trainer hands
DeepSpeed a torch optimizer, which at ZeRO stages 0-3 needs none of those ops,
so `no_jit_ops()` marks every op unavailable before the probe runs: DeepSpeed
then falls back to plain torch.distributed (gloo / NCCL) and compiles nothing.
"""

from __future__ import annotations

import os

from tlt.services.common.ports import free_port


def no_jit_ops() -> None:
    """Tell DeepSpeed that no compiled op is available (skips probing and JIT builds)."""
    import deepspeed.ops as ds_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    if "__compatible_ops__" not in vars(ds_ops):  # not probed yet: probing is lazy (module __getattr__)
        ds_ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def init_process_group(backend: str | None = None) -> None:
    """Initialise torch.distributed once per process (a no-op when already done)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    no_jit_ops()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ:  # started by a launcher: it set the rendezvous variables
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        return
    # A world of one on loopback. Passed explicitly, not through os.environ, so child
    # processes (e.g. a trainer started by a test or by `tlt run`) do not inherit a
    # rendezvous that is not theirs. Only LOCAL_RANK is set: DeepSpeed's engine asserts it.
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend=backend, verbose=False, auto_mpi_discovery=False,
                               init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def is_main() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def world_size() -> int:
    """Ranks of the process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast(obj: object) -> object:
    """Rank 0's `obj` on every rank (pickled; for small control data and completions)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown_process_group() -> None:
    """Every rank done: meet, then tear the group down before the interpreter exits. Left to exit, a rank whose peer
    had already gone could abort in gloo's threads ("terminate called without an active exception", exit -6) after
    its work was done: a launcher then reports a finished run as failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
