"""The receiver's checks on a weight update, at their edges: where a shm file may lie, and byte ranges that touch.

Real files (in pytest's tmp folder and in shm_dir()) read through `read_shm`, and hand-built manifests over real
payloads through `validate`/`unpack`. The existing cases (tests/test_weights_format.py) refuse /etc/passwd, which
the file-name check alone already refuses, and overlaps of many bytes; these pin the folder check and the
one-byte edge.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest
import torch

from tlt.services.common import weights as W
from tlt.v1 import common_pb2, rollout_pb2


def _name() -> str:
    return f"{W.SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.bin"


def test_a_correctly_named_weights_file_outside_the_shm_folder_is_refused(tmp_path: Path) -> None:
    """A manifest's shm_path names a file the receiver reads: only one in shm_dir() itself. A file named as a TLT
    weights file elsewhere (another folder, a subfolder of shm_dir(), or reached through `<shm_dir>/../`) is
    refused before it is opened; the same bytes in shm_dir() are read (the check is not refusing everything)."""
    outside = tmp_path / _name()
    outside.write_bytes(b"secret")
    up = "../" * (len(W.shm_dir().resolve().parts) - 1)  # from shm_dir() up to /
    through_parent = f"{W.shm_dir()}/{up}{str(outside).lstrip('/')}"
    assert Path(through_parent).resolve() == outside.resolve() and Path(through_parent).read_bytes() == b"secret"
    sub = W.shm_dir() / f"tlt-test-{uuid.uuid4().hex}"
    sub.mkdir()
    inside = W.shm_dir() / _name()
    try:
        (sub / outside.name).write_bytes(b"secret")
        inside.write_bytes(b"secret")
        for path in (str(outside), through_parent, str(sub / outside.name), f"{sub}/../{up}{str(outside).lstrip('/')}"):
            with pytest.raises(W.WeightValidationError, match="is not a TLT weight file in"):
                W.read_shm(path)
        assert bytes(W.read_shm(str(inside))) == b"secret"
        assert bytes(W.read_shm(f"{sub}/../{inside.name}")) == b"secret"  # a path into shm_dir() itself
    finally:
        W.remove_shm(str(inside))
        W.remove_shm(str(sub / outside.name))
        sub.rmdir()


def test_a_link_in_the_shm_folder_is_not_followed(tmp_path: Path) -> None:
    """A correctly named symbolic link in shm_dir() (anyone may create one in /dev/shm) pointing at a file elsewhere
    is refused, not read through: the receiver opens the file itself (O_NOFOLLOW); so are a folder and a FIFO by
    that name (opened without blocking: a FIFO would wait for a writer forever)."""
    outside = tmp_path / "private"
    outside.write_bytes(b"secret")
    link, folder, fifo = W.shm_dir() / _name(), W.shm_dir() / _name(), W.shm_dir() / _name()
    link.symlink_to(outside)
    folder.mkdir()
    os.mkfifo(fifo)  # no writer: opened without waiting for one, then refused
    try:
        for path in (link, folder, fifo):
            with pytest.raises(W.WeightValidationError, match="not a regular TLT weight file"):
                W.read_shm(str(path))
    finally:
        link.unlink()
        folder.rmdir()
        fifo.unlink()


def _manifest(specs: list[tuple[str, int, int]], total: int) -> tuple[rollout_pb2.WeightManifest, bytearray]:
    """uint8 tensors (name, nbytes, offset) over a payload of `total` bytes (byte i holds i % 251)."""
    payload = bytearray(i % 251 for i in range(total))
    tensors = [common_pb2.TensorSpec(name=n, dtype=common_pb2.DTYPE_UINT8, shape=[k], offset=o, nbytes=k)
               for n, k, o in specs]
    return rollout_pb2.WeightManifest(kind=common_pb2.WEIGHT_KIND_POLICY, version=1, tensors=tensors,
                                      total_bytes=total, sha256=hashlib.sha256(payload).hexdigest()), payload


def test_adjacent_tensors_pass_and_a_one_byte_overlap_is_refused() -> None:
    """a [0, 16) and b [16, 32) touch without sharing a byte: accepted, each tensor its own bytes. b one byte
    earlier, [15, 31), shares byte 15 with a: refused, naming both; so is c [31, 47), sharing byte 31 with b
    [16, 32) where b follows a gap after a [0, 8)."""
    manifest, payload = _manifest([("a", 16, 0), ("b", 16, 16)], 64)
    out = W.unpack(manifest, payload)
    assert out["a"].tolist() == list(range(16)) and out["b"].tolist() == list(range(16, 32))

    manifest, payload = _manifest([("a", 16, 0), ("b", 16, 15)], 64)
    with pytest.raises(W.WeightValidationError) as e:
        W.validate(manifest, payload)
    assert "tensors 'a' [0, 16) and 'b' [15, 31) overlap" in str(e.value)

    manifest, payload = _manifest([("a", 8, 0), ("b", 16, 16), ("c", 16, 31)], 64)
    with pytest.raises(W.WeightValidationError) as e:
        W.validate(manifest, payload)
    assert "tensors 'b' [16, 32) and 'c' [31, 47) overlap" in str(e.value) and "'a'" not in str(e.value)
