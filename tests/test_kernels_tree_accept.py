"""The acceptance walk: hand-built trees on both paths, random trees kernel against reference.

The "interpreter" cases need TRITON_INTERPRET=1 from process start: they run in
the child process of tests/test_kernels_interpreter.py and skip elsewhere. The
"cuda" cases run the compiled kernel on a GPU (marked `gpu`). Nothing is faked.
"""

from __future__ import annotations

import pytest
import torch

from tlt.kernels.launch import interpreter_ready
from tlt.kernels.tree_accept import Acceptance, tree_accept_ref, tree_accept_triton

# "ref" runs the reference; the others run the kernel (interpreter on CPU, compiled on CUDA).
IMPLS = [
    pytest.param("ref", id="ref"),
    pytest.param("cpu", id="interpreter"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture
def walk(request: pytest.FixtureRequest):
    kind = request.param
    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if kind == "cpu" and not interpreter_ready():
        pytest.skip("needs TRITON_INTERPRET=1 from process start: runs in tests/test_kernels_interpreter.py's child")

    def run(draft: list[list[int]], parents: list[list[int]], target: list[list[int]]) -> Acceptance:
        d, p, t = (torch.tensor(x, dtype=torch.int64) for x in (draft, parents, target))
        if kind == "ref":
            return tree_accept_ref(d, p, t)
        device = torch.device(kind)
        n = d.shape[1]
        poisoned = Acceptance(  # poison: unwritten outputs fail
            accept_len=torch.full((d.shape[0],), -7, dtype=torch.int64, device=device),
            path=torch.full((d.shape[0], n), -7, dtype=torch.int64, device=device),
            bonus=torch.full((d.shape[0],), -7, dtype=torch.int64, device=device),
        )
        out = tree_accept_triton(d.to(device), p.to(device), t.to(device), out=poisoned)
        return Acceptance(out.accept_len.cpu(), out.path.cpu(), out.bonus.cpu())

    return run


def as_lists(a: Acceptance) -> tuple[list[int], list[list[int]], list[int]]:
    return a.accept_len.tolist(), a.path.tolist(), a.bonus.tolist()


@pytest.mark.parametrize("walk", IMPLS, indirect=True)
def test_hand_built_trees(walk) -> None:
    # Chain 0 -> 1 -> 2 -> 3 with draft tokens [r, 10, 11, 12].
    chain_draft, chain_parents = [[99, 10, 11, 12]], [[-1, 0, 1, 2]]
    # Full accept: the target agrees at every level and emits 13 after the leaf.
    assert as_lists(walk(chain_draft, chain_parents, [[10, 11, 12, 13]])) == ([3], [[0, 1, 2, 3]], [13])
    # Partial: agrees on 10, then wants 50 instead of 11: one accepted, bonus 50.
    assert as_lists(walk(chain_draft, chain_parents, [[10, 50, 12, 13]])) == ([1], [[0, 1, -1, -1]], [50])
    # First-level reject: the target wants 77 at the root; nothing accepted, bonus 77.
    assert as_lists(walk(chain_draft, chain_parents, [[77, 11, 12, 13]])) == ([0], [[0, -1, -1, -1]], [77])
    # Branching: root children 1 (tok 5) and 2 (tok 7); 1 -> 3 (tok 9); 2 -> 4 (tok 11), 5 (tok 12).
    # The target picks 7 at the root (second child), then 12 at node 2 (its second child), then 40.
    draft, parents = [[99, 5, 7, 9, 11, 12]], [[-1, 0, 0, 1, 2, 2]]
    assert as_lists(walk(draft, parents, [[7, 9, 12, 0, 0, 40]])) == ([2], [[0, 2, 5, -1, -1, -1]], [40])
    # Same tree, the target wants 9 at node 2: token 9 exists, but under node 1, not node 2: stop.
    assert as_lists(walk(draft, parents, [[7, 9, 9, 0, 0, 40]])) == ([1], [[0, 2, -1, -1, -1, -1]], [9])
    # A root alone (N = 1): the bonus is the target's token after the root.
    assert as_lists(walk([[99]], [[-1]], [[8]])) == ([0], [[0]], [8])
    # Batch of two with padding nodes (parent -1) that can never be reached.
    got = walk([[99, 5, 5, 0], [98, 3, 4, 4]], [[-1, 0, -1, -1], [-1, 0, 1, -1]], [[5, 6, 0, 0], [3, 4, 1, 0]])
    assert as_lists(got) == ([1, 2], [[0, 1, -1, -1], [0, 1, 2, -1]], [6, 1])


def random_trees(batch: int, nodes: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random trees with distinct child tokens, and targets that often follow a branch."""
    draft = torch.zeros(batch, nodes, dtype=torch.int64)
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    target = torch.randint(0, vocab, (batch, nodes), generator=gen)
    for b in range(batch):
        used: dict[int, set[int]] = {}
        for i in range(1, nodes):
            # Half the nodes extend the previous one, so trees are deep as well as wide.
            parent = i - 1 if torch.rand((), generator=gen) < 0.5 else int(torch.randint(0, i, (1,), generator=gen))
            free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
            if not free:
                continue  # parent full: leave node i as unreachable padding
            token = free[int(torch.randint(0, len(free), (1,), generator=gen))]
            used[parent].add(token)
            draft[b, i], parents[b, i] = token, parent
            if torch.rand((), generator=gen) < 0.7:
                target[b, parent] = token  # the target follows this child (later children may override)
    return draft, parents, target


def check_walk_is_valid(draft: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, result: Acceptance) -> None:
    """Independent check of the walk's definition on one result."""
    for b in range(draft.shape[0]):
        n = int(result.accept_len[b])
        path = result.path[b].tolist()
        assert path[0] == 0 and all(x == -1 for x in path[n + 1 :])
        for prev, node in zip(path[:n], path[1 : n + 1]):
            assert parents[b, node] == prev and draft[b, node] == target[b, prev]
        last = path[n]
        children = [j for j in range(1, draft.shape[1]) if parents[b, j] == last]
        assert all(draft[b, j] != target[b, last] for j in children)  # the walk stopped for a reason
        assert result.bonus[b] == target[b, last]


@pytest.mark.parametrize("walk", IMPLS[1:], indirect=True)
@pytest.mark.parametrize("nodes", [2, 7, 33])
def test_kernel_matches_reference_on_random_trees(walk, nodes: int) -> None:
    gen = torch.Generator().manual_seed(nodes)
    draft, parents, target = random_trees(6, nodes, vocab=4, gen=gen)
    want = tree_accept_ref(draft, parents, target)
    check_walk_is_valid(draft, parents, target, want)
    assert want.accept_len.max() >= 2 or nodes == 2  # the trees exercise multi-level accepts
    got = walk(draft.tolist(), parents.tolist(), target.tolist())
    assert as_lists(got) == as_lists(want)


def test_wrapper_rejects_bad_inputs() -> None:
    d = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        tree_accept_triton(d.int(), d, d)
    with pytest.raises(ValueError, match="parents must be"):
        tree_accept_triton(d, d[:, :3], d)


@pytest.mark.parametrize("walk", [IMPLS[1]], indirect=True)
def test_interpreter_runtime_loop_bounds_with_triton_3_6_scalar_conversion(walk, monkeypatch: pytest.MonkeyPatch) -> None:
    # Triton 3.6's interpreter turns a runtime scalar into a Python int with int(array of shape (1,)), which
    # NumPy >= 2.4 refuses: every kernel that loops over runtime bounds (range(1, N) here, the block range of
    # paged attention) failed under TRITON_INTERPRET=1 with triton 3.6 (the GPU machines' version, allowed by
    # pyproject). Reproduced here on any triton by installing 3.6's conversion; LazyKernel converts as 3.7 does.
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def like_triton_3_6(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", like_triton_3_6)
    assert as_lists(walk([[99, 10, 11, 12]], [[-1, 0, 1, 2]], [[10, 11, 12, 13]])) == ([3], [[0, 1, 2, 3]], [13])


def test_wrapper_rejects_strided_out_buffers() -> None:
    # The kernel stores accept_len[b] and bonus[b] at offset b from the base pointer: a strided view such as a
    # column of a [B, 2] buffer kept its poison for sequence 1, whose values overwrote memory outside the view.
    d = torch.zeros(2, 4, dtype=torch.int64)
    good = torch.zeros(2, dtype=torch.int64)
    strided = torch.zeros(2, 2, dtype=torch.int64)[:, 0]
    path = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="accept_len must be contiguous"):
        tree_accept_triton(d, d, d, out=Acceptance(strided, path, good))
    with pytest.raises(ValueError, match="bonus must be contiguous"):
        tree_accept_triton(d, d, d, out=Acceptance(good, path, strided))
