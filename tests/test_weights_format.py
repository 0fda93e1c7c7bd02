"""The weight-transfer format: exact round trips and every corruption class rejected by name.

Everything here is real (torch tensors, protobuf messages, files in /dev/shm);
no gRPC server is needed because the format is transport-independent.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt.services.common import weights as W
from tlt.v1 import common_pb2, rollout_pb2

POLICY = common_pb2.WEIGHT_KIND_POLICY


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "layer.0.w_half": torch.randn(3, 3, generator=g).half(),
        "layer.0.w_bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "positions": torch.arange(-5, 6, dtype=torch.int64),
        "ids32": torch.tensor([1, -2, 2**31 - 1], dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous: packed as its values, C order
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _roundtrip(tensors: dict[str, torch.Tensor], **kw: int) -> dict[str, torch.Tensor]:
    manifest, payload = W.pack_state_dict(tensors, POLICY, 3)
    m2, p2 = W.assemble(W.iter_chunks(manifest, payload, **kw))
    assert m2 == manifest
    return W.unpack(m2, p2, W.expected_specs(tensors))


def test_round_trip_is_bit_exact_for_every_dtype() -> None:
    src = _tensors()
    out = _roundtrip(src, chunk_bytes=13)  # odd chunk size: chunk edges cut through tensors
    assert list(out) == list(src)
    for name, t in src.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(_bits(out[name]), _bits(t)), name


def test_bf16_special_values_survive() -> None:
    t = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 3.0e38], dtype=torch.bfloat16)
    out = _roundtrip({"x": t})["x"]
    assert torch.equal(_bits(out), _bits(t))


def test_manifest_describes_payload() -> None:
    src = _tensors()
    manifest, payload = W.pack_state_dict(src, common_pb2.WEIGHT_KIND_DRAFTER, 12)
    assert manifest.kind == common_pb2.WEIGHT_KIND_DRAFTER and manifest.version == 12
    assert manifest.total_bytes == len(payload)
    assert manifest.sha256 == hashlib.sha256(payload).hexdigest()
    spec = {s.name: s for s in manifest.tensors}
    assert spec["layer.0.w_bf16"].dtype == common_pb2.DTYPE_BFLOAT16
    assert list(spec["layer.0.w_bf16"].shape) == [4, 6] and spec["layer.0.w_bf16"].nbytes == 48
    assert all(s.offset % W.ALIGN == 0 for s in manifest.tensors)
    # little-endian raw bytes: int64 -5 is fb ff ff ff ff ff ff ff
    off = spec["positions"].offset
    assert bytes(payload[off : off + 8]) == bytes([0xFB] + [0xFF] * 7)


def test_chunks_start_with_manifest_and_respect_size() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    chunks = list(W.iter_chunks(manifest, payload, chunk_bytes=100))
    assert chunks[0].WhichOneof("part") == "manifest"
    assert all(c.WhichOneof("part") == "data" and 0 < len(c.data) <= 100 for c in chunks[1:])
    assert b"".join(c.data for c in chunks[1:]) == bytes(payload)


def _reject(manifest: rollout_pb2.WeightManifest, payload: bytes, match: str, expected=None) -> str:
    with pytest.raises(W.WeightValidationError, match=match) as e:
        W.unpack(manifest, payload, expected)
    return str(e.value)


def test_bit_flip_fails_checksum() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    payload[70] ^= 0x04
    _reject(manifest, payload, "checksum mismatch")


def test_truncated_payload_rejected_by_assemble_and_unpack() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    chunks = list(W.iter_chunks(manifest, payload, chunk_bytes=64))
    with pytest.raises(W.WeightValidationError, match="truncated"):
        W.assemble(chunks[:-1])
    _reject(manifest, bytes(payload[:-10]), "truncated")


def test_assemble_refuses_malformed_streams() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    chunks = list(W.iter_chunks(manifest, payload, chunk_bytes=64))
    with pytest.raises(W.WeightValidationError, match="before the manifest"):
        W.assemble(chunks[1:])
    with pytest.raises(W.WeightValidationError, match="second manifest"):
        W.assemble([chunks[0], *chunks])
    with pytest.raises(W.WeightValidationError, match="more than"):
        W.assemble([*chunks, rollout_pb2.WeightChunk(data=b"x")])
    with pytest.raises(W.WeightValidationError, match="without a manifest"):
        W.assemble([])
    with pytest.raises(W.WeightValidationError, match="over the limit"):
        W.assemble(chunks, max_total_bytes=manifest.total_bytes - 1)


def test_assemble_stops_reading_an_oversized_stream() -> None:
    manifest, payload = W.pack_state_dict({"x": torch.zeros(4)}, POLICY, 1)
    consumed = []

    def endless():
        yield rollout_pb2.WeightChunk(manifest=manifest)
        for i in range(1000):
            consumed.append(i)
            yield rollout_pb2.WeightChunk(data=b"\0" * 64)

    with pytest.raises(W.WeightValidationError, match="more than"):
        W.assemble(endless())
    assert len(consumed) <= 2


def test_wrong_shape_wrong_dtype_unknown_and_missing_names() -> None:
    src = _tensors()
    manifest, payload = W.pack_state_dict(src, POLICY, 1)
    expected = W.expected_specs(src)

    wrong_shape = dict(expected, **{"embed.weight": ((5, 7), torch.float32)})
    msg = _reject(manifest, payload, "shape", wrong_shape)
    assert "'embed.weight': shape [7, 5], expected [5, 7]" in msg

    wrong_dtype = dict(expected, **{"layer.0.w_bf16": ((4, 6), torch.float16)})
    msg = _reject(manifest, payload, "dtype", wrong_dtype)
    assert "'layer.0.w_bf16': dtype torch.bfloat16, expected torch.float16" in msg

    fewer = {k: v for k, v in expected.items() if k != "mask"}
    _reject(manifest, payload, r"unexpected tensors: \['mask'\]", fewer)

    more = dict(expected, **{"lm_head.weight": ((7, 5), torch.float32)})
    _reject(manifest, payload, r"missing tensors: \['lm_head.weight'\]", more)


def test_overlapping_and_out_of_range_offsets() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    bad = rollout_pb2.WeightManifest()
    bad.CopyFrom(manifest)
    bad.tensors[1].offset = bad.tensors[0].offset + 4  # inside embed.weight's bytes
    msg = _reject(bad, payload, "overlap")
    assert "'embed.weight'" in msg and "'layer.0.w_half'" in msg

    bad.CopyFrom(manifest)
    bad.tensors[0].offset = manifest.total_bytes - 8
    _reject(bad, payload, "out of range")


def test_inconsistent_spec_unknown_dtype_duplicates_and_kind() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    bad = rollout_pb2.WeightManifest()
    bad.CopyFrom(manifest)
    bad.tensors[0].nbytes += 4
    _reject(bad, payload, "nbytes 144 != 140")

    bad.CopyFrom(manifest)
    bad.tensors[0].dtype = 99
    _reject(bad, payload, "unknown dtype 99")

    bad.CopyFrom(manifest)
    bad.tensors[0].dtype = common_pb2.DTYPE_UNSPECIFIED
    _reject(bad, payload, "unknown dtype DTYPE_UNSPECIFIED")

    bad.CopyFrom(manifest)
    bad.tensors[1].name = bad.tensors[0].name
    _reject(bad, payload, "appears twice")

    bad.CopyFrom(manifest)
    bad.kind = common_pb2.WEIGHT_KIND_UNSPECIFIED
    _reject(bad, payload, "kind is unspecified")


def test_every_problem_reported_together() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 1)
    payload[0] ^= 1
    msg = _reject(manifest, payload, "checksum", {"other": ((1,), torch.float32)})
    assert "missing tensors" in msg and "unexpected tensors" in msg


def test_unaligned_foreign_offsets_still_unpack() -> None:
    # Another implementation may pack without padding: offsets need not be aligned.
    t = torch.arange(6, dtype=torch.float32)
    raw = b"\x01" + _bits(t).numpy().tobytes()
    spec = common_pb2.TensorSpec(name="x", dtype=common_pb2.DTYPE_FLOAT32, shape=[2, 3], offset=1, nbytes=24)
    manifest = rollout_pb2.WeightManifest(
        kind=POLICY, version=1, tensors=[spec], total_bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest()
    )
    assert torch.equal(W.unpack(manifest, raw)["x"], t.reshape(2, 3))


def test_pack_refuses_unsupported_dtype_and_kind() -> None:
    with pytest.raises(ValueError, match="complex64"):
        W.pack_state_dict({"c": torch.zeros(2, dtype=torch.complex64)}, POLICY, 1)
    with pytest.raises(ValueError, match="kind"):
        W.pack_state_dict({"x": torch.zeros(2)}, common_pb2.WEIGHT_KIND_UNSPECIFIED, 1)


def test_shm_path_round_trip_and_cleanup() -> None:
    src = _tensors()
    manifest, payload = W.pack_state_dict(src, POLICY, 5)
    with W.shm_payload(manifest, payload) as shm_manifest:
        path = shm_manifest.shm_path
        assert Path(path).exists() and Path(path).parent == W.shm_dir()
        assert manifest.shm_path == ""  # the original is untouched
        chunks = list(W.iter_chunks(shm_manifest, None))
        assert len(chunks) == 1  # no data after the manifest
        m2, p2 = W.assemble(chunks)
        out = W.unpack(m2, p2, W.expected_specs(src))
        assert all(torch.equal(_bits(out[k]), _bits(v)) for k, v in src.items())
    assert not Path(path).exists()


def test_shm_rejects_foreign_paths_and_data_chunks(tmp_path: Path) -> None:
    with pytest.raises(W.WeightValidationError, match="not a TLT weight file"):
        W.read_shm("/etc/passwd")
    with pytest.raises(W.WeightValidationError, match="does not exist"):
        W.read_shm(str(W.shm_dir() / f"{W.SHM_PREFIX}1-gone.bin"))
    manifest, payload = W.pack_state_dict({"x": torch.ones(3)}, POLICY, 1)
    with W.shm_payload(manifest, payload) as shm_manifest:
        with pytest.raises(W.WeightValidationError, match="data chunks followed"):
            W.assemble([rollout_pb2.WeightChunk(manifest=shm_manifest), rollout_pb2.WeightChunk(data=b"x")])


def test_sweep_removes_files_of_dead_writers() -> None:
    dead_pid = 2**22 + 12345  # above the default pid_max on Linux
    stale = W.shm_dir() / f"{W.SHM_PREFIX}{dead_pid}-feedface.bin"
    stale.write_bytes(b"old")
    live = W.write_shm(b"new")
    try:
        removed = W.sweep_stale_shm()
        assert str(stale) in removed and not stale.exists()
        assert Path(live).exists()
    finally:
        W.remove_shm(live)
        W.remove_shm(str(stale))


def test_failed_shm_write_leaves_no_file_behind() -> None:
    """A write that fails part way (a full /dev/shm: here a real EFBIG from RLIMIT_FSIZE in a child process)
    raises and removes its half-written file."""
    import subprocess
    import sys

    code = (
        "import resource, signal, glob, os, torch\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))\n"
        "from tlt.services.common import weights as W\n"
        "m, p = W.pack_state_dict({'x': torch.zeros(1 << 16)}, 1, 1)\n"
        "try:\n"
        "    with W.shm_payload(m, p):\n"
        "        raise SystemExit('written past the size limit')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "left = sorted(glob.glob(str(W.shm_dir() / f'{W.SHM_PREFIX}{os.getpid()}-*')))\n"
        "print('left', left)\n"
        "for f in left: os.unlink(f)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused" in out.stdout and "left []" in out.stdout, out.stdout


def test_merge_keeps_earlier_tensors_a_partial_update_did_not_carry() -> None:
    src = _tensors()
    base_m, base_p = W.pack_state_dict(src, POLICY, 1)
    upd = {"mask": torch.tensor([False, False, True]), "embed.weight": torch.ones(7, 5)}
    upd_m, upd_p = W.pack_state_dict(upd, POLICY, 2)
    m, p = W.merge(base_m, base_p, upd_m, upd_p)
    assert m.version == 2 and m.kind == POLICY
    out = W.unpack(m, p, W.expected_specs(src))
    for name, t in {**src, **upd}.items():
        assert torch.equal(_bits(out[name]), _bits(t)), name
    m_full, p_full = W.merge(base_m, base_p, *W.pack_state_dict(src, POLICY, 3))  # carries all: kept as it is
    assert m_full.version == 3 and bytes(p_full) == bytes(base_p)


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


@st.composite
def _state_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    n = draw(st.integers(1, 5))
    out = {}
    for i in range(n):
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        dtype = draw(st.sampled_from(_DTYPES))
        raw = torch.randint(0, 256, (max(1, math.prod(shape)) * dtype.itemsize,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31))))
        out[f"t{i}"] = raw[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
    return out


@settings(max_examples=60, deadline=None)
@given(_state_dicts(), st.integers(1, 300))
def test_any_state_dict_round_trips_bit_exact(tensors: dict[str, torch.Tensor], chunk: int) -> None:
    out = _roundtrip(tensors, chunk_bytes=chunk)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(_bits(out[name]), _bits(t))


@settings(max_examples=60, deadline=None)
@given(_state_dicts(), st.data())
def test_any_single_bit_flip_is_rejected(tensors: dict[str, torch.Tensor], data: st.DataObject) -> None:
    manifest, payload = W.pack_state_dict(tensors, POLICY, 1)
    if not payload:
        return
    i = data.draw(st.integers(0, len(payload) - 1))
    payload[i] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(W.WeightValidationError, match="checksum"):
        W.unpack(manifest, payload)


def test_sweep_removes_a_dead_writers_file_whose_pid_a_live_process_reuses() -> None:
    """Files were keyed on the writer's pid alone. A pid is reused: in a restarted container the trainer gets the
    same small pid again, so the file its killed predecessor left (GBs of weights in /dev/shm) looked live to the
    sweep forever. Here the reused pid is this process's own, with another start time."""
    import os

    reused = W.shm_dir() / f"{W.SHM_PREFIX}{os.getpid()}.1-feedface.bin"  # started at tick 1: not this process
    reused.write_bytes(b"old")
    live = W.write_shm(b"new")
    try:
        removed = W.sweep_stale_shm()
        assert str(reused) in removed and not reused.exists()
        assert Path(live).exists() and live not in removed
    finally:
        W.remove_shm(live)
        W.remove_shm(str(reused))


def _hand_manifest(specs: list[tuple[str, int, int]], total: int) -> tuple[rollout_pb2.WeightManifest, bytearray]:
    """float32 tensors (name, elements, offset) over a zero payload of `total` bytes, checksum right."""
    payload = bytearray(total)
    tensors = [common_pb2.TensorSpec(name=n, dtype=common_pb2.DTYPE_FLOAT32, shape=[k], offset=o, nbytes=4 * k)
               for n, k, o in specs]
    return rollout_pb2.WeightManifest(kind=POLICY, version=1, tensors=tensors, total_bytes=total,
                                      sha256=hashlib.sha256(payload).hexdigest()), payload


def test_overlap_is_checked_against_the_furthest_reaching_range() -> None:
    # a [0, 256) holds b [64, 128) and c [192, 256): both overlap a, though c does not overlap b (the range
    # sorted just before it); checking each range only against its predecessor misses a/c
    manifest, payload = _hand_manifest([("a", 64, 0), ("b", 16, 64), ("c", 16, 192)], 256)
    msg = _reject(manifest, payload, "overlap")
    assert "'a' [0, 256) and 'b' [64, 128) overlap" in msg
    assert "'a' [0, 256) and 'c' [192, 256) overlap" in msg


def test_an_empty_tensor_inside_another_ones_bytes_is_no_overlap() -> None:
    # a foreign sender may put a 0-byte tensor at any offset: it shares no bytes with anything
    manifest, payload = _hand_manifest([("a", 64, 0), ("none", 0, 64)], 256)
    out = W.unpack(manifest, payload)
    assert out["none"].shape == (0,) and torch.equal(out["a"], torch.zeros(64))


def test_select_takes_a_name_asked_twice_once() -> None:
    manifest, payload = W.pack_state_dict(_tensors(), POLICY, 4)
    sub, sub_payload = W.select(manifest, payload, ["mask", "scalar", "mask"])
    assert [s.name for s in sub.tensors] == ["mask", "scalar"]
    assert [s.offset for s in sub.tensors] == [0, 64] and sub.total_bytes == 64 + 4
    out = W.unpack(sub, sub_payload)
    assert torch.equal(out["mask"], _tensors()["mask"]) and float(out["scalar"]) == 3.5
