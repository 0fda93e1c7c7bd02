"""The one weight-transfer format: policy and drafter pushes from the trainer to the rollout.

    state dict --pack_state_dict--> (WeightManifest, payload)
               --iter_chunks------> WeightChunk stream (manifest first, then data)   [gRPC UpdateWeights]
               --assemble---------> (WeightManifest, payload)                         [receiver]
               --unpack-----------> dict[str, Tensor], validated entirely or WeightValidationError
    (WeightManifest, payload) --select--> the same format holding only some of its tensors  [GetWeights]
    base + partial update     --merge---> what a receiver holds after both (replayed to a restarted replica)

The payload is the tensors' bytes, C-contiguous and little-endian, laid out
one after another at 64-byte aligned offsets (zero padding between them);
`TensorSpec` gives each tensor's name, dtype, shape, offset and size, and the
manifest carries the payload's total size and its sha256. bf16 travels as its
raw 2-byte patterns, so every dtype round-trips bit for bit.

A weight update is atomic: `unpack` checks everything (checksum, sizes,
offsets in range and non-overlapping, known dtypes, and optionally the names,
shapes and dtypes the receiver expects) before it builds a single tensor, so a
bad update is rejected whole and changes nothing.

Same-host shortcut: `write_shm(payload)` writes the payload to a file under
/dev/shm (the temp folder where /dev/shm does not exist) and the manifest's
`shm_path` names it; then no data chunks follow the manifest and the receiver
reads the file. Cleanup: the SENDER owns the file and removes it once the
UpdateWeights call has returned (use `shm_payload(...)` as a context manager,
which removes it even when the call fails); `sweep_stale_shm()` removes files
left by processes that died (a file's name carries its writer's pid and start
time, so a reused pid does not keep a dead writer's file). The receiver only reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import stat
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from tlt.v1 import common_pb2, rollout_pb2

WeightManifest = rollout_pb2.WeightManifest
WeightChunk = rollout_pb2.WeightChunk
Buffer = bytes | bytearray | memoryview

ALIGN = 64
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_MAX_TOTAL_BYTES = 1 << 37  # 128 GiB: a 32B-parameter model in fp32 still fits
SHM_PREFIX = "tlt-weights-"

TORCH_DTYPES: dict[int, torch.dtype] = {
    common_pb2.DTYPE_FLOAT32: torch.float32,
    common_pb2.DTYPE_FLOAT16: torch.float16,
    common_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    common_pb2.DTYPE_INT64: torch.int64,
    common_pb2.DTYPE_INT32: torch.int32,
    common_pb2.DTYPE_UINT8: torch.uint8,
    common_pb2.DTYPE_BOOL: torch.bool,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}

ExpectedSpecs = Mapping[str, tuple[Sequence[int], torch.dtype]]

if sys.byteorder != "little":  # the wire format is little-endian and we copy raw bytes
    raise ImportError("tlt weight transfer needs a little-endian host")


class WeightValidationError(ValueError):
    """A weight update is malformed or does not match the receiver's model; nothing was applied."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat uint8 CPU tensor (bf16 included)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def pack_state_dict(tensors: Mapping[str, torch.Tensor], kind: int, version: int) -> tuple[WeightManifest, bytearray]:
    """Lay `tensors` out in one payload and describe it in a manifest (`kind`: a `WeightKind`)."""
    if kind == common_pb2.WEIGHT_KIND_UNSPECIFIED:
        raise ValueError("pack_state_dict needs kind=WEIGHT_KIND_POLICY or WEIGHT_KIND_DRAFTER")
    specs: list[common_pb2.TensorSpec] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in WIRE_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(map(str, WIRE_DTYPES))}")
        nbytes = t.numel() * t.element_size()
        offset = _aligned(offset)
        specs.append(
            common_pb2.TensorSpec(
                name=name, dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape), offset=offset, nbytes=nbytes
            )
        )
        offset += nbytes
    payload = bytearray(offset)
    if offset:
        dst = torch.frombuffer(payload, dtype=torch.uint8)
        for spec, t in zip(specs, tensors.values()):
            if spec.nbytes:
                dst[spec.offset : spec.offset + spec.nbytes].copy_(_as_bytes(t))
    manifest = WeightManifest(
        kind=kind, version=version, tensors=specs, total_bytes=offset, sha256=hashlib.sha256(payload).hexdigest()
    )
    return manifest, payload


def iter_chunks(
    manifest: WeightManifest, payload: Buffer | None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[WeightChunk]:
    """The UpdateWeights client stream: the manifest, then the payload in pieces (none for shm)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    yield WeightChunk(manifest=manifest)
    if manifest.shm_path:
        return
    if payload is None or len(payload) != manifest.total_bytes:
        got = None if payload is None else len(payload)
        raise ValueError(f"payload has {got} bytes but the manifest says {manifest.total_bytes}")
    view = memoryview(payload)
    for start in range(0, len(view), chunk_bytes):
        yield WeightChunk(data=bytes(view[start : start + chunk_bytes]))


def assemble(
    chunks: Iterable[WeightChunk], max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
) -> tuple[WeightManifest, bytearray]:
    """Rebuild (manifest, payload) from a chunk stream; reads the shm file when the manifest names one.

    Refuses a stream whose declared or actual size exceeds `max_total_bytes`
    before buffering it, a second manifest, data before the manifest, and a
    stream whose size differs from the manifest's. Contents are checked by `unpack`.
    """
    manifest: WeightManifest | None = None
    payload = bytearray()
    for chunk in chunks:
        part = chunk.WhichOneof("part")
        if part == "manifest":
            if manifest is not None:
                raise WeightValidationError("a second manifest arrived in one weight stream")
            manifest = chunk.manifest
            if manifest.total_bytes > max_total_bytes:
                raise WeightValidationError(
                    f"update declares {manifest.total_bytes} bytes, over the limit of {max_total_bytes}"
                )
        elif part == "data":
            if manifest is None:
                raise WeightValidationError("weight data arrived before the manifest; send the manifest first")
            if manifest.shm_path:
                raise WeightValidationError(f"manifest names shm file {manifest.shm_path} but data chunks followed")
            if len(payload) + len(chunk.data) > manifest.total_bytes:
                raise WeightValidationError(
                    f"stream carries more than the {manifest.total_bytes} bytes the manifest declares"
                )
            payload += chunk.data
        else:
            raise WeightValidationError("empty WeightChunk (neither manifest nor data)")
    if manifest is None:
        raise WeightValidationError("weight stream ended without a manifest")
    if manifest.shm_path:
        payload = read_shm(manifest.shm_path, max_bytes=max_total_bytes)
    if len(payload) != manifest.total_bytes:
        raise WeightValidationError(
            f"payload truncated: got {len(payload)} bytes, the manifest declares {manifest.total_bytes}"
        )
    return manifest, payload


def select(manifest: WeightManifest, payload: Buffer, names: Sequence[str]) -> tuple[WeightManifest, bytearray]:
    """The named tensors of a packed update, repacked alone (same kind and version; bytes copied as they are).

    Raises KeyError naming the tensors the manifest does not have."""
    specs = {s.name: s for s in manifest.tensors}
    missing = [n for n in names if n not in specs]
    if missing:
        raise KeyError(f"tensors not in the {_enum_name(common_pb2.WeightKind, manifest.kind)} v{manifest.version} "
                       f"weights: {missing}")
    view = memoryview(payload)
    out = bytearray()
    picked: list[common_pb2.TensorSpec] = []
    for name in dict.fromkeys(names):
        s = specs[name]
        offset = _aligned(len(out))
        out += bytes(offset - len(out))
        out += view[s.offset : s.offset + s.nbytes]
        picked.append(common_pb2.TensorSpec(name=name, dtype=s.dtype, shape=list(s.shape), offset=offset, nbytes=s.nbytes))
    sub = WeightManifest(kind=manifest.kind, version=manifest.version, tensors=picked, total_bytes=len(out),
                         sha256=hashlib.sha256(out).hexdigest())
    return sub, out


def merge(base_manifest: WeightManifest, base_payload: Buffer, manifest: WeightManifest, payload: Buffer
          ) -> tuple[WeightManifest, bytes]:
    """What a receiver holds after applying `base` then the (partial) update `manifest`/`payload`:
    every tensor of the update, plus those of `base` it does not carry; the update's kind and version.
    Both must be valid (`validate`); bytes are copied as they are."""
    carried = {s.name for s in manifest.tensors}
    keep = [s for s in base_manifest.tensors if s.name not in carried]
    if not keep:
        return manifest, bytes(payload)
    out = bytearray(payload)
    specs = [common_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=s.offset, nbytes=s.nbytes)
             for s in manifest.tensors]
    view = memoryview(base_payload)
    for s in keep:
        offset = _aligned(len(out))
        out += bytes(offset - len(out))
        out += view[s.offset : s.offset + s.nbytes]
        specs.append(common_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=list(s.shape), offset=offset,
                                           nbytes=s.nbytes))
    merged = WeightManifest(kind=manifest.kind, version=manifest.version, tensors=specs, total_bytes=len(out),
                            sha256=hashlib.sha256(out).hexdigest())
    return merged, bytes(out)


def expected_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) per name a receiver expects, from its own parameters."""
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def validate(manifest: WeightManifest, payload: Buffer, expected: ExpectedSpecs | None = None) -> None:
    """Raise `WeightValidationError` listing every problem; return only when the update is sound."""
    problems: list[str] = []
    if manifest.kind == common_pb2.WEIGHT_KIND_UNSPECIFIED:
        problems.append("manifest kind is unspecified (must be POLICY or DRAFTER)")
    if len(payload) != manifest.total_bytes:
        problems.append(f"payload truncated: {len(payload)} bytes, manifest declares {manifest.total_bytes}")
    elif hashlib.sha256(payload).hexdigest() != manifest.sha256.lower():
        problems.append(f"checksum mismatch: payload sha256 is not the manifest's {manifest.sha256[:16]}...")
    seen: set[str] = set()
    ranges: list[tuple[int, int, str]] = []
    for spec in manifest.tensors:
        where = f"tensor {spec.name!r}"
        if not spec.name:
            problems.append("a tensor has an empty name")
        if spec.name in seen:
            problems.append(f"{where} appears twice")
        seen.add(spec.name)
        dtype = TORCH_DTYPES.get(spec.dtype)
        if dtype is None:
            problems.append(f"{where} has unknown dtype {_enum_name(common_pb2.DType, spec.dtype)}")
            continue
        if any(d < 0 for d in spec.shape):
            problems.append(f"{where} has a negative dimension in shape {list(spec.shape)}")
            continue
        want = math.prod(spec.shape) * dtype.itemsize
        if spec.nbytes != want:
            problems.append(f"{where}: nbytes {spec.nbytes} != {want} for shape {list(spec.shape)} {dtype}")
        if spec.offset + spec.nbytes > manifest.total_bytes:
            problems.append(
                f"{where}: bytes [{spec.offset}, {spec.offset + spec.nbytes}) out of range of the "
                f"{manifest.total_bytes}-byte payload"
            )
        ranges.append((spec.offset, spec.offset + spec.nbytes, spec.name))
    problems += _overlaps(ranges)
    if expected is not None:
        problems += _compare(manifest, expected)
    if problems:
        head = f"rejected {_enum_name(common_pb2.WeightKind, manifest.kind)} update v{manifest.version}"
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise WeightValidationError(head + ":\n  " + "\n  ".join(shown))


def _overlaps(ranges: list[tuple[int, int, str]]) -> list[str]:
    """Pairs of non-empty byte ranges that share bytes (ranges: (start, end, name))."""
    problems = []
    reach: tuple[int, int, str] | None = None  # the range reaching furthest so far
    for start, end, name in sorted(r for r in ranges if r[1] > r[0]):
        if reach is not None and start < reach[1]:
            problems.append(f"tensors {reach[2]!r} [{reach[0]}, {reach[1]}) and {name!r} [{start}, {end}) overlap")
        if reach is None or end > reach[1]:
            reach = (start, end, name)
    return problems


def _enum_name(enum: object, value: int) -> str:
    return enum.Name(value) if value in enum.values() else str(value)  # type: ignore[attr-defined]


def _compare(manifest: WeightManifest, expected: ExpectedSpecs) -> list[str]:
    problems: list[str] = []
    got = {s.name: s for s in manifest.tensors}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    for name, (shape, dtype) in expected.items():
        spec = got.get(name)
        if spec is None:
            continue
        if tuple(spec.shape) != tuple(shape):
            problems.append(f"tensor {name!r}: shape {list(spec.shape)}, expected {list(shape)}")
        have = TORCH_DTYPES.get(spec.dtype)
        if have is not None and have != dtype:
            problems.append(f"tensor {name!r}: dtype {have}, expected {dtype}")
    return problems


def unpack(manifest: WeightManifest, payload: Buffer, expected: ExpectedSpecs | None = None) -> dict[str, torch.Tensor]:
    """Validate everything, then return CPU tensors by name (views sharing one copy of the payload)."""
    validate(manifest, payload, expected)
    buf = payload if isinstance(payload, bytearray) else bytearray(payload)
    base = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for spec in manifest.tensors:
        dtype = TORCH_DTYPES[spec.dtype]
        raw = base[spec.offset : spec.offset + spec.nbytes]
        if spec.offset % dtype.itemsize:
            raw = raw.clone()  # a foreign sender's unaligned offset: copy so the dtype view is legal
        out[spec.name] = raw.view(dtype).reshape(tuple(spec.shape))
    return out


# ---- same-host shared memory -------------------------------------------------------------


def shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def write_shm(payload: Buffer) -> str:
    """Write the payload to a new file in shared memory and return its path (the caller removes it)."""
    final = shm_dir() / f"{SHM_PREFIX}{_writer_id(os.getpid())}-{uuid.uuid4().hex}.bin"
    tmp = final.with_suffix(".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, final)  # readers never see a half-written file
    except BaseException:  # e.g. ENOSPC on a small /dev/shm: leave no half-written file behind
        remove_shm(str(tmp))
        raise
    return str(final)


def read_shm(path: str, max_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> bytearray:
    """Read a payload written by `write_shm`; refuses paths that are not TLT shm files."""
    p = Path(path)
    if p.parent.resolve() != shm_dir().resolve() or not p.name.startswith(SHM_PREFIX) or p.suffix != ".bin":
        raise WeightValidationError(f"shm path {path!r} is not a TLT weight file in {shm_dir()}")
    try:  # the file itself, not where a link in the shared folder points
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO by that name: no wait for a writer
    except FileNotFoundError:
        raise WeightValidationError(f"shm file {path} does not exist (removed by the sender, or another host?)") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise WeightValidationError(f"shm path {path!r} is not a regular TLT weight file ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise WeightValidationError(f"shm path {path!r} is not a regular TLT weight file")
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        if size > max_bytes:
            raise WeightValidationError(f"shm file {path} has {size} bytes, over the limit of {max_bytes}")
        buf = bytearray(size)
        got = f.readinto(buf)
    if got != size:
        raise WeightValidationError(f"shm file {path}: read {got} of {size} bytes")
    return buf


def remove_shm(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def shm_payload(manifest: WeightManifest, payload: Buffer) -> Iterator[WeightManifest]:
    """`with shm_payload(m, p) as m2:` send `m2` alone; the file is removed when the block exits."""
    path = write_shm(payload)
    try:
        shm_manifest = WeightManifest()
        shm_manifest.CopyFrom(manifest)
        shm_manifest.shm_path = path
        yield shm_manifest
    finally:
        remove_shm(path)


def _start_ticks(pid: int) -> str:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); "" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()  # after "(comm)", which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def _writer_id(pid: int) -> str:
    """`pid.start` of a writer: a pid alone is reused (in a restarted container the trainer gets the same small
    pid again), and a file of a dead writer whose pid a live process now has would never be swept."""
    start = _start_ticks(pid)
    return f"{pid}.{start}" if start else str(pid)


def sweep_stale_shm() -> list[str]:
    """Remove TLT weight files whose writer process no longer exists (its pid is gone, or now belongs to a process
    that started at another time); return their paths."""
    removed = []
    for p in shm_dir().glob(f"{SHM_PREFIX}*"):
        writer = p.name[len(SHM_PREFIX) :].split("-", 1)[0]
        pid_text, _, start = writer.partition(".")
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
            gone = bool(start) and _start_ticks(int(pid_text)) not in ("", start)
        except ProcessLookupError:
            gone = True
        except PermissionError:
            gone = bool(start) and _start_ticks(int(pid_text)) not in ("", start)  # alive, someone else's
        if gone:
            remove_shm(str(p))
            removed.append(str(p))
    return removed
