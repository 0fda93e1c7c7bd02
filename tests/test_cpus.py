"""CPU thread groups (services/common/cpus.py): which cores a replica and its drafter worker get."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from tlt.services.common.cpus import available_cpus, cpu_group, pin


def test_groups_by_hand():
    cpus = [0, 1, 2, 3, 4, 5]
    assert [cpu_group(i, 2, cpus) for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert cpu_group(3, 2, cpus) == [0, 1]  # more groups than cores: wraps around
    assert cpu_group(1, 4, cpus) == [4, 5, 0, 1]
    assert cpu_group(0, 9, cpus) == cpus  # never more threads than cores
    assert cpu_group(5, 1, [2, 7]) == [7]  # only the cores this process may use


def _child(cores, q):  # noqa: ANN001
    pin(cores)
    q.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_pin_restricts_a_process_to_its_group():
    cores = cpu_group(1, 1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(cores, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == cores and set(got) <= set(available_cpus())
