"""Mutation audit of the drafter (`tlt/model/drafter.py`), its decoding runtime (`tlt/model/drafter_runtime.py`)
and the weight-push format (`services/common/weights.py`): each test here pins a behaviour that a small deliberate
change to that code (a mutant) broke while the rest of the suite still passed. The audit ID in each test's comment
names the mutant it kills (Y- drafter, Z- runtime, X- weights).

Nothing is faked: tiny drafters are built in code with random weights, weight updates are packed, chunked and
read back through the real functions, shm files are real files in shm_dir(), and the writer ids are checked
against psutil's reading of the process start time. Expected values are derived independently (by hand, from
the module's own non-cached forward, or from the documented alignment) rather than from the code under test.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import uuid

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tiny_drafter import H, V, random_drafter, tiny_config

from tlt.model.config import RopeScaling
from tlt.model.drafter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Drafter,
    DrafterCache,
    DrafterConfig,
    DrafterError,
    check_drafter_folder,
    folder_identity,
    load_drafter,
    read_drafter_config,
    tensors_identity,
)
from tlt.model.drafter_runtime import DrafterRuntime
from tlt.services.common import weights as W
from tlt.v1 import common_pb2

POLICY = common_pb2.WEIGHT_KIND_POLICY


# ---- weights: serialisation, integrity, shared memory ------------------------------------------------------------


def test_iter_chunks_refuses_a_payload_shorter_or_longer_than_the_manifest() -> None:
    # the sender checks the payload against the manifest before streaming a byte of data; a short payload
    # (`>` instead of `!=`) was streamed and only the receiver noticed
    manifest, payload = W.pack_state_dict({"x": torch.arange(10, dtype=torch.float32)}, POLICY, 1)
    assert manifest.total_bytes == 40
    for bad in (payload[:-1], payload + b"\0", None):
        chunks = W.iter_chunks(manifest, bad)
        assert next(chunks).WhichOneof("part") == "manifest"
        got = None if bad is None else len(bad)
        with pytest.raises(ValueError, match=f"payload has {got} bytes but the manifest says 40"):
            next(chunks)


def test_an_upper_case_checksum_from_another_sender_is_accepted() -> None:
    # sha256 hex digests compare case-insensitively (a foreign sender may write upper case hex)
    t = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    manifest, payload = W.pack_state_dict(t, POLICY, 7)
    manifest.sha256 = hashlib.sha256(payload).hexdigest().upper()
    assert manifest.sha256 != manifest.sha256.lower()
    out = W.unpack(manifest, payload, W.expected_specs(t))
    assert torch.equal(out["w"], t["w"])
    payload[0] ^= 1  # still a checksum: upper case is not "anything goes"
    with pytest.raises(W.WeightValidationError, match="checksum mismatch"):
        W.unpack(manifest, payload)


def test_a_shm_file_exactly_at_the_size_limit_is_read() -> None:
    # the limit is inclusive (`size > max_bytes` refuses); one byte over is refused
    path = W.write_shm(b"0123456789")
    try:
        assert bytes(W.read_shm(path, max_bytes=10)) == b"0123456789"
        with pytest.raises(W.WeightValidationError, match="has 10 bytes, over the limit of 9"):
            W.read_shm(path, max_bytes=9)
    finally:
        W.remove_shm(path)


def test_a_half_written_part_file_is_not_read_as_a_payload() -> None:
    # only a finished `.bin` file is a payload; write_shm writes `<name>.part` first and renames it when
    # complete, so a manifest naming a `.part` file (a writer still writing, or one that died) is refused
    part = W.shm_dir() / f"{W.SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.part"
    done = part.with_suffix(".bin")
    part.write_bytes(b"half")
    done.write_bytes(b"whole")
    try:
        with pytest.raises(W.WeightValidationError, match="is not a TLT weight file in"):
            W.read_shm(str(part))
        assert bytes(W.read_shm(str(done))) == b"whole"
    finally:
        W.remove_shm(str(part))
        W.remove_shm(str(done))

def test_the_writer_id_carries_the_process_start_time_not_a_field_that_changes() -> None:
    # X-17: /proc/<pid>/stat field 22 (starttime) is what tells a reused pid apart; the next field (vsize) moves as
    # the process maps memory, which made a live writer's file look dead to the sweep
    pid = os.getpid()
    ticks = round((psutil.Process(pid).create_time() - psutil.boot_time()) * os.sysconf("SC_CLK_TCK"))
    assert W._writer_id(pid) == f"{pid}.{ticks}"
    live = W.write_shm(b"live")
    region = mmap.mmap(-1, 1 << 30)  # 1 GiB of address space, never touched: vsize grows, nothing is used
    try:
        assert W._writer_id(pid) == f"{pid}.{ticks}"
        assert live not in W.sweep_stale_shm()
        assert os.path.exists(live)
    finally:
        region.close()
        W.remove_shm(live)


def test_the_sweep_leaves_a_file_whose_name_names_no_pid_alone() -> None:
    # a file with the prefix but no pid after it (someone else's, or a hand-made name) is skipped, not a
    # ValueError that stops the whole sweep (and with it the removal of dead writers' files)
    foreign = W.shm_dir() / f"{W.SHM_PREFIX}notapid-{uuid.uuid4().hex}.bin"
    dead = W.shm_dir() / f"{W.SHM_PREFIX}{2**22 + 4321}-{uuid.uuid4().hex}.bin"  # above Linux's default pid_max
    foreign.write_bytes(b"x")
    dead.write_bytes(b"y")
    try:
        removed = W.sweep_stale_shm()
        assert foreign.exists() and str(foreign) not in removed
        assert str(dead) in removed and not dead.exists()
    finally:
        W.remove_shm(str(foreign))
        W.remove_shm(str(dead))


# ---- the drafter: config, shared tensors, identity, folders ------------------------------------------------------


def test_a_config_with_rope_scaling_survives_its_json_and_scales_the_drafters_frequencies(tmp_path) -> None:
    # Y-2: from_json rebuilds rope_scaling as a RopeScaling (left a dict, the config neither equalled the one saved
    # nor could scale the rotary frequencies of a Llama-3 style target)
    c = tiny_config(rope_theta=10000.0, rope_scaling=RopeScaling("linear", factor=4.0))
    back = DrafterConfig.from_json(c.to_json())
    assert back == c and isinstance(back.rope_scaling, RopeScaling)
    d = Drafter(c, torch.randn(V, H), torch.randn(V, H))
    d.save(tmp_path / "dr")
    loaded = read_drafter_config(tmp_path / "dr")
    assert loaded == c
    want = torch.tensor([10000.0 ** (-i / 8) / 4.0 for i in (0, 2, 4, 6)])  # theta^(-2i/d) / factor, by hand
    torch.testing.assert_close(Drafter(loaded, d.embed, d.lm_head).inv_freq, want)


def test_a_target_lm_head_of_the_wrong_shape_is_refused() -> None:
    # Y-3: both shared tensors are shape-checked (the lm_head's too, not only the embedding's)
    d = random_drafter()
    with pytest.raises(DrafterError, match=r"target lm_head has shape \(40, 33\), the drafter expects \(40, 32\)"):
        d.set_shared(d.embed, torch.zeros(V, H + 1))
    with pytest.raises(DrafterError, match="target lm_head has shape"):
        Drafter(d.cfg, torch.zeros(V, H), torch.zeros(V + 1, H))


def test_the_lm_head_is_held_by_reference_and_an_in_place_update_is_seen() -> None:
    # Y-4: lm_head shares the target's storage (an in-place policy update of the head reaches the drafter at once)
    torch.manual_seed(0)
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    d = Drafter(tiny_config(), embed, lm_head)
    assert d.lm_head.data_ptr() == lm_head.data_ptr() and d.embed.data_ptr() == embed.data_ptr()
    h = torch.randn(2, H)
    with torch.no_grad():
        lm_head.mul_(2.0)
    torch.testing.assert_close(d.compute_logits(h), h @ lm_head.T)


def test_the_identity_depends_on_which_name_holds_which_values() -> None:
    # Y-16: names are part of the identity: two same-shaped tensors swapped are another drafter
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert tensors_identity({"fc.weight": a, "layer.x": b}) != tensors_identity({"fc.weight": b, "layer.x": a})
    # and the documented format, written out: sha256 over "name:shape;" then the float32 bytes, per sorted name
    h = hashlib.sha256()
    for name, t in (("fc.weight", a), ("layer.x", b)):
        h.update(f"{name}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    assert tensors_identity({"layer.x": b, "fc.weight": a}) == f"sha256:{h.hexdigest()[:16]}"


def test_the_identity_is_the_same_whatever_float_dtype_stores_the_weights(tmp_path) -> None:
    # Y-17: values are hashed as float32, so a bf16 or fp16 copy of the same (representable) weights is the same
    # drafter: the identity of a folder written in bf16 equals that of the float32 weights it holds
    d = random_drafter()
    own = {k: v.detach().to(torch.bfloat16).float() for k, v in d.state_dict().items()}  # bf16-representable
    ident = tensors_identity(own)
    assert tensors_identity({k: v.to(torch.bfloat16) for k, v in own.items()}) == ident
    assert tensors_identity({k: v.half() for k, v in own.items()}) == tensors_identity(
        {k: v.half().float() for k, v in own.items()})
    d.load_tensors(own)
    d.to(torch.bfloat16).save(tmp_path / "bf16")
    assert load_file(str(tmp_path / "bf16" / WEIGHTS_FILE))["fc.weight"].dtype == torch.bfloat16
    assert folder_identity(tmp_path / "bf16") == ident


def test_a_folder_with_a_config_but_no_weights_file_is_not_a_drafter_folder(tmp_path) -> None:
    # Y-24: both files are required (`or`): a folder holding only drafter_config.json was let through and the load
    # failed later with a bare FileNotFoundError from safetensors
    d = random_drafter()
    d.save(tmp_path / "dr")
    (tmp_path / "dr" / WEIGHTS_FILE).unlink()
    with pytest.raises(DrafterError, match="is not a drafter folder: it needs"):
        check_drafter_folder(tmp_path / "dr")
    with pytest.raises(DrafterError, match="is not a drafter folder"):
        load_drafter(tmp_path / "dr", d.embed, d.lm_head)
    d.save(tmp_path / "only_weights")
    (tmp_path / "only_weights" / CONFIG_FILE).unlink()
    with pytest.raises(DrafterError, match="is not a drafter folder"):
        check_drafter_folder(tmp_path / "only_weights")


# ---- the runtime: cache rows, rotary tables, chain drafting -------------------------------------------------------


def _as_module(d: Drafter, rt: DrafterRuntime, ids: torch.Tensor, f: torch.Tensor, pos: torch.Tensor,
               c_mod: DrafterCache, c_rt: DrafterCache, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The runtime's forward of (ids, features) at `pos` over cache rows `rows`, checked against the nn.Module's
    over its own cache (which gathers rows by index) -> (the runtime's output, the module's)."""
    got, want = rt(ids, f, pos, c_rt, rows), d(ids, f, pos, cache=c_mod, cache_rows=rows)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    return got, want


def _prefill(d: Drafter, rt: DrafterRuntime, c_mod: DrafterCache, c_rt: DrafterCache, row: int, n: int, first_pos: int,
             g: torch.Generator) -> None:
    """n true pairs into cache row `row` of both caches (module path and runtime path), positions first_pos.."""
    ids, f = torch.randint(0, V, (1, n), generator=g), torch.randn(1, n, H, generator=g)
    _as_module(d, rt, ids, f, torch.arange(first_pos, first_pos + n)[None], c_mod, c_rt, torch.tensor([row]))


@torch.inference_mode()
def test_runtime_rows_that_are_not_consecutive_read_their_own_cache_rows() -> None:
    # Z-1 (the old suite kills it too, through rows [2, 0]; this pins [0, 2], whose first row matches): rows [0, 2]
    # start like the consecutive [0, 1]: only rows consecutive all the way may be read as a view (`.all()`); read
    # as [0, 1] they attend row 1's keys. Reference: the module, which gathers by index.
    d = random_drafter(5)
    rt = DrafterRuntime(d)
    c_mod, c_rt = DrafterCache(d.cfg, rows=3, capacity=8), DrafterCache(d.cfg, rows=3, capacity=8)
    g = torch.Generator().manual_seed(5)
    for row in (0, 1, 2):
        _prefill(d, rt, c_mod, c_rt, row, 4, 0, g)  # equal lengths: no mask, every key of the row read
    ids, f, pos = torch.randint(0, V, (2, 1), generator=g), torch.randn(2, 1, H, generator=g), torch.tensor([[4], [4]])
    _as_module(d, rt, ids, f, pos, c_mod, c_rt, torch.tensor([0, 2]))


@torch.inference_mode()
def test_runtime_positions_at_the_end_of_the_rotary_table_grow_it() -> None:
    # Z-15: positions 0 .. max are read, so the table must hold max + 1 rows (the first table holds 256)
    d = random_drafter(6)
    rt = DrafterRuntime(d)
    assert rt._cos.shape[0] == 256
    g = torch.Generator().manual_seed(6)
    ids, f = torch.randint(0, V, (1, 2), generator=g), torch.randn(1, 2, H, generator=g)
    caches = (DrafterCache(d.cfg, rows=1, capacity=4), DrafterCache(d.cfg, rows=1, capacity=4))
    _as_module(d, rt, ids, f, torch.tensor([[255, 256]]), *caches, torch.tensor([0]))


@torch.inference_mode()
def test_a_greedy_chain_over_uneven_non_consecutive_rows_equals_the_modules_chain() -> None:
    # Z-17 (the survivor: the rotary table one row short); Z-1, Z-2, Z-3, Z-4, Z-6, Z-7 fail here too (the old
    # suite kills those in test_spec_eagle / test_drafter_runtime). A chain drafted by the runtime equals the one
    # the nn.Module drafts step by step (argmax token k fed back as the pair (token, h') at position root_pos + k,
    # appended after the row's cache): rows of different cached lengths (each sees its own keys only), rows [0, 2]
    # (not a view), and a root whose last draft sits at position 256, one past the first rotary table
    d = random_drafter(7)
    rt = DrafterRuntime(d)
    c_mod, c_rt = DrafterCache(d.cfg, rows=3, capacity=4), DrafterCache(d.cfg, rows=3, capacity=4)
    g = torch.Generator().manual_seed(7)
    depth = 4
    lengths, root_pos = (6, 5, 2), torch.tensor([253, 40])  # cached pairs per row 0, 1, 2; roots of rows 0 and 2
    for row, n in enumerate(lengths):
        first = 253 - n if row == 0 else 40 - n
        _prefill(d, rt, c_mod, c_rt, row, n, first, g)
    rows = torch.tensor([0, 2])
    ids, f = torch.randint(0, V, (2, 1), generator=g), torch.randn(2, 1, H, generator=g)  # the root pairs
    h_rt, h_mod = (h[:, 0] for h in _as_module(d, rt, ids, f, root_pos[:, None], c_mod, c_rt, rows))
    before = c_rt.lengths.clone()
    toks, scores, probs = rt.chain(h_rt, c_rt, rows, root_pos, depth)
    assert probs is None and toks.shape == scores.shape == (2, depth)
    assert torch.equal(c_rt.lengths, before)  # the chain leaves the rows' lengths as they were
    h, total, want_toks, want_scores = h_mod, torch.zeros(2), [], []
    for k in range(depth):
        best, tok = d.compute_logits(h).log_softmax(-1).max(-1)
        total = total + best
        want_toks.append(tok)
        want_scores.append(total)
        if k + 1 < depth:
            h = d(tok[:, None], h[:, None], (root_pos + k + 1)[:, None], cache=c_mod, cache_rows=rows)[:, 0]
    assert toks.tolist() == torch.stack(want_toks, 1).tolist()
    torch.testing.assert_close(scores, torch.stack(want_scores, 1), rtol=1e-4, atol=1e-4)


def _certain_drafter() -> tuple[Drafter, torch.Tensor]:
    """A drafter whose output is one constant vector c whatever it is fed (every embedding row is e, attention
    and MLP write nothing, fc passes the embedding half), and whose lm_head puts logit 100 * |c| on token 3 and 0
    on every other: each draft is token 3 with log-probability exactly 0.0 in float32 (e^-100 is far below
    float32's resolution at 1)."""
    torch.manual_seed(8)
    c = tiny_config()
    embed = torch.randn(H).expand(V, H).contiguous()
    d = Drafter(c, embed, torch.zeros(V, H))
    with torch.no_grad():
        for p in d.parameters():
            p.zero_()
        d.fc.weight[:, :H] = torch.eye(H)
        out = embed[0].clone()  # what the layer returns: x = fc(cat(e, h)) = e, plus nothing
        lm_head = torch.zeros(V, H)
        lm_head[3] = 100.0 * out / out.norm()
    d.set_shared(embed, lm_head)
    return d.eval(), out


@torch.inference_mode()
def test_a_chain_is_not_stopped_by_a_score_equal_to_min_score() -> None:
    # Z-5: drafting stops once every row is BELOW min_score (`<`): a score exactly at it is kept by the caller's cut
    # (scores >= min_score), so the drafts after it are drafted too. Certain drafts (log-prob 0.0) with min_score 0.
    d, out = _certain_drafter()
    rt = DrafterRuntime(d)
    assert d.compute_logits(out).log_softmax(-1).max().item() == 0.0
    cache = DrafterCache(d.cfg, rows=2, capacity=4)
    h = out.expand(2, H).contiguous()
    toks, scores, _ = rt.chain(h, cache, torch.tensor([0, 1]), torch.tensor([5, 9]), 4, min_score=0.0)
    assert toks.tolist() == [[3, 3, 3, 3], [3, 3, 3, 3]] and scores.eq(0.0).all()
    toks, _, _ = rt.chain(h, cache, torch.tensor([0, 1]), torch.tensor([5, 9]), 4, min_score=1e-6)
    assert toks.tolist() == [[3], [3]]  # every row below the floor after the first draft: nothing deeper
