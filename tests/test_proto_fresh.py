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


def test_a_failed_regeneration_keeps_the_generated_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m tlt.protogen` deleted every *_pb2* module before running protoc: a broken .proto left
    none and the package no longer imported. Now protoc writes into a temporary folder and the modules
    are replaced only when it succeeds. Runs on a copy of the tree (the real proto/ is not touched)."""
    _copy_tree(tmp_path)
    monkeypatch.setattr(protogen, "ROOT", tmp_path)
    monkeypatch.setattr(protogen, "PROTO_DIR", tmp_path / "proto")
    out = tmp_path / "tlt" / "v1"
    before = {p.name: p.read_bytes() for p in out.glob("*_pb2*.py*")}
    assert "reward_pb2.py" in before and "rollout_pb2_grpc.py" in before

    reward = tmp_path / "proto" / "tlt" / "v1" / "reward.proto"
    good = reward.read_text()
    reward.write_text(good.replace("bool correct = 5;", "bool correct = 5 this is not protobuf"))
    with pytest.raises(RuntimeError, match="protoc failed"):
        protogen.main([])
    assert {p.name: p.read_bytes() for p in out.glob("*_pb2*.py*")} == before
    assert not list(tmp_path.glob(".protogen-*")), "the temporary folder is removed"

    # a successful run replaces the modules (and removes those of a proto that no longer exists)
    reward.write_text(good.replace("bool correct = 5;", "bool correct = 5;\n  string verdict_detail = 6;"))
    (out / "removed_pb2.py").write_text("# generated from a proto that no longer exists\n")
    assert protogen.main([]) == 0
    after = {p.name: p.read_bytes() for p in out.glob("*_pb2*.py*")}
    assert set(after) == set(before) and b"verdict_detail" in after["reward_pb2.py"]
    assert after["rollout_pb2.py"] == before["rollout_pb2.py"]
    assert protogen.stale_files() == []
