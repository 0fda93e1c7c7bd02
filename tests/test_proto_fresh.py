"""The committed generated protobuf code must match `proto/` exactly.

`tlt.protogen.stale_files()` regenerates every `tlt/v1/*_pb2*` module into a
temporary folder and compares it byte for byte with the committed ones. The
second test proves the check can fail: it copies the protos and the generated
code into a temporary tree, edits one .proto there, points `tlt.protogen` at
that tree and expects the matching generated files to be reported stale.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tlt.protogen as protogen


def test_committed_generated_code_is_fresh() -> None:
    stale = protogen.stale_files()
    assert stale == [], f"stale generated code {stale}: run `.venv/bin/python -m tlt.protogen` and commit"


def test_every_proto_has_generated_modules() -> None:
    out = protogen.ROOT / "tlt" / "v1"
    for proto in protogen.proto_files():
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (out / f"{proto.stem}{suffix}").exists(), f"{proto.name} has no {proto.stem}{suffix}"


def _copy_tree(tmp: Path) -> None:
    shutil.copytree(protogen.PROTO_DIR, tmp / "proto")
    shutil.copytree(protogen.ROOT / "tlt" / "v1", tmp / "tlt" / "v1", ignore=shutil.ignore_patterns("__pycache__"))


def test_check_detects_a_modified_proto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _copy_tree(tmp_path)
    monkeypatch.setattr(protogen, "ROOT", tmp_path)
    monkeypatch.setattr(protogen, "PROTO_DIR", tmp_path / "proto")
    assert protogen.stale_files() == [], "an unmodified copy must be fresh"

    reward = tmp_path / "proto" / "tlt" / "v1" / "reward.proto"
    text = reward.read_text()
    assert "bool correct = 5;" in text
    reward.write_text(text.replace("bool correct = 5;", "bool correct = 5;\n  string verdict_detail = 6;"))
    stale = protogen.stale_files()
    assert "reward_pb2.py" in stale
    assert "reward_pb2.pyi" in stale
    assert not any(name.startswith("rollout_") for name in stale), stale
    assert protogen.main(["--check"]) == 1


def test_check_detects_a_leftover_generated_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _copy_tree(tmp_path)
    monkeypatch.setattr(protogen, "ROOT", tmp_path)
    monkeypatch.setattr(protogen, "PROTO_DIR", tmp_path / "proto")
    (tmp_path / "tlt" / "v1" / "removed_pb2.py").write_text("# generated from a proto that no longer exists\n")
    assert protogen.stale_files() == ["removed_pb2.py"]


def test_check_detects_a_hand_edited_generated_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _copy_tree(tmp_path)
    monkeypatch.setattr(protogen, "ROOT", tmp_path)
    monkeypatch.setattr(protogen, "PROTO_DIR", tmp_path / "proto")
    edited = tmp_path / "tlt" / "v1" / "events_pb2.py"
    edited.write_text(edited.read_text() + "\n# a hand edit\n")
    (tmp_path / "tlt" / "v1" / "common_pb2.pyi").unlink()
    assert protogen.stale_files() == ["common_pb2.pyi", "events_pb2.py"]
