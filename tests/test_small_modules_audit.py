"""Gaps a mutation audit found in four small modules' tests: tlt/protogen.py, services/rollout/backends.py,
services/rollout/sglang_backend/model_info.py and services/trainer/run_env.py.

Nothing is faked: protogen runs the real grpc_tools protoc on a copy of proto/ and tlt/v1/ in tmp_path (as
tests/test_proto_fresh.py does; the real tree is not touched), `engine_class("sglang")` imports the real adapter
module (which imports SGLang itself only when an engine starts, so it loads without the optional extra), the
checkpoints are tiny config.json / safetensors files written here, and run_env reads the real environment, set
with monkeypatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tlt.protogen as protogen
from test_proto_fresh import _copy_tree


@pytest.fixture()
def proto_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of proto/ and tlt/v1/ that tlt.protogen is pointed at."""
    _copy_tree(tmp_path)
    monkeypatch.setattr(protogen, "ROOT", tmp_path)
    monkeypatch.setattr(protogen, "PROTO_DIR", tmp_path / "proto")
    return tmp_path


# -- tlt/protogen.py --------------------------------------------------------------------------


def test_check_exits_0_when_fresh_and_1_naming_every_stale_file_on_stderr(proto_tree: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Kills P-14 (--check on fresh code returned 1), P-15 (the stale message went to stdout) and P-16 (the
    message named only the first stale file): `make` and CI read the exit status, a person reads stderr."""
    assert protogen.main(["--check"]) == 0
    out = capsys.readouterr()
    assert out.out == "generated code is fresh\n" and out.err == ""

    events = proto_tree / "tlt" / "v1" / "events_pb2.py"
    events.write_text(events.read_text() + "\n# a hand edit\n")
    (proto_tree / "tlt" / "v1" / "common_pb2.pyi").unlink()
    assert protogen.main(["--check"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "stale generated code: common_pb2.pyi, events_pb2.py (run `python -m tlt.protogen`)\n"


def test_leftover_grpc_and_stub_modules_are_stale_and_regeneration_removes_them(proto_tree: Path) -> None:
    """Kills P-12 (only leftover `*_pb2.py` counted: a proto's removal left its `_pb2_grpc.py` and `.pyi` unseen),
    P-13 (the stale names unsorted: changed files first, then leftovers) and P-24 (regeneration removed only
    leftover `*_pb2.py`)."""
    out = proto_tree / "tlt" / "v1"
    for name in ("aaa_pb2_grpc.py", "aaa_pb2.pyi"):
        (out / name).write_text("# generated from a proto that no longer exists\n")
    events = out / "events_pb2.py"
    events.write_text(events.read_text() + "\n# a hand edit\n")
    assert protogen.stale_files() == ["aaa_pb2.pyi", "aaa_pb2_grpc.py", "events_pb2.py"]
    assert protogen.main([]) == 0
    assert not (out / "aaa_pb2_grpc.py").exists() and not (out / "aaa_pb2.pyi").exists()
    assert protogen.stale_files() == []


def test_a_proto_importing_a_well_known_type_generates(proto_tree: Path) -> None:
    """Kills P-3 (protoc ran without grpc_tools' bundled `_proto` include): no proto imports
    google/protobuf/*.proto today, so the committed-code check passed; the first that did would fail to build."""
    (proto_tree / "proto" / "tlt" / "v1" / "stamp.proto").write_text(
        'syntax = "proto3";\npackage tlt.v1;\nimport "google/protobuf/timestamp.proto";\n'
        "message Stamp { google.protobuf.Timestamp at = 1; }\n")
    assert protogen.stale_files() == ["stamp_pb2.py", "stamp_pb2.pyi", "stamp_pb2_grpc.py"]


def test_regeneration_writes_into_a_hidden_temporary_folder_beside_the_package(
        proto_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kills P-17 (the temporary folder in the system's temp dir): `os.replace` is atomic only on one file system, and
    from a /tmp on another one (a tmpfs) it fails with EXDEV; regenerate() writes under ROOT and removes the folder."""
    seen: list[Path] = []
    real = protogen.generate

    def spy(out_root: Path) -> list[Path]:
        seen.append(out_root)
        return real(out_root)

    monkeypatch.setattr(protogen, "generate", spy)
    assert protogen.regenerate() == proto_tree / "tlt" / "v1"
    (tmp,) = seen
    assert tmp.parent == proto_tree and tmp.name.startswith(".protogen-")
    assert not tmp.exists()


# -- services/rollout/backends.py -------------------------------------------------------------


def test_backend_names_and_module_class_paths_resolve_to_engine_classes() -> None:
    """Kills B-2 (`sglang` named another class of the adapter module): only the native name was exercised, by
    the servers' tests; a 'module:Class' path is imported as given."""
    from tlt.services.rollout.backends import engine_class
    from tlt.services.rollout.engine.engine import LLMEngine
    from tlt.services.rollout.sglang_backend.engine import SGLangEngine

    assert engine_class("native") is LLMEngine
    assert engine_class("sglang") is SGLangEngine
    assert engine_class("tlt.services.rollout.sglang_backend.engine:SGLangEngine") is SGLangEngine


@pytest.mark.parametrize("name", ["sgl", "Native", "SGLANG"])
def test_an_unknown_backend_is_refused_naming_the_choices(name: str) -> None:
    """Kills B-6 (no check: "sgl" failed as "not enough values to unpack"), B-7 (the choices left out of the
    message) and B-9 (names matched case-insensitively, which the config validator refuses)."""
    from tlt.services.rollout.backends import engine_class

    with pytest.raises(ValueError) as e:
        engine_class(name)
    assert str(e.value) == f"unknown rollout backend {name!r}; use one of ['native', 'sglang'] or 'module:Class'"


# -- services/rollout/sglang_backend/model_info.py --------------------------------------------


def _model(folder: Path, gen: dict | None = None, **cfg) -> str:  # noqa: ANN003
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if gen is not None:
        (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


def test_model_info_reads_sizes_and_eos_from_config_then_generation_config(tmp_path: Path) -> None:
    """Kills M-1 (config.json's eos_token_id ignored), M-2 (a generation_config.json without eos_token_id dropped
    config.json's), M-3 (config.json beat generation_config.json, which transformers lets win), M-5 (a list of
    EOS ids refused), M-6 (no EOS anywhere read as id 0), M-7 / M-8 (vocab and hidden sizes swapped) and M-9 (the
    context length of a config that does not give one: 32768, not 4096)."""
    from tlt.services.rollout.sglang_backend.model_info import ModelInfo

    base = {"vocab_size": 64, "hidden_size": 8, "max_position_embeddings": 128}
    assert ModelInfo.from_dir(_model(tmp_path / "a", **base, eos_token_id=2)) == ModelInfo(64, 8, 128, (2,))
    assert ModelInfo.from_dir(_model(tmp_path / "b", {"eos_token_id": [2, 7]}, **base, eos_token_id=2)) \
        .eos_token_ids == (2, 7)
    assert ModelInfo.from_dir(_model(tmp_path / "c", {"eos_token_id": 5}, **base, eos_token_id=2)).eos_token_ids == (5,)
    assert ModelInfo.from_dir(_model(tmp_path / "d", {"temperature": 0.7}, **base, eos_token_id=2)) \
        .eos_token_ids == (2,)
    assert ModelInfo.from_dir(_model(tmp_path / "e", **base)).eos_token_ids == ()
    bare = ModelInfo.from_dir(_model(tmp_path / "f", vocab_size=64, hidden_size=8))
    assert bare == ModelInfo(64, 8, 32768, ())


def test_checkpoint_specs_name_every_safetensors_dtype_as_torch_does(tmp_path: Path) -> None:
    """Kills M-12, M-13, M-14 (a dtype mapped to another torch name: a push of the right dtype refused, or of a
    wrong one accepted) and M-15 (a dtype the map lacks read as float32 instead of the header's own name)."""
    from safetensors.torch import save_file

    from tlt.services.rollout.sglang_backend.model_info import checkpoint_specs

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    tensors = {f"w.{str(d).removeprefix('torch.')}": torch.zeros(2, 3, dtype=d) for d in dtypes}
    tensors["w.unlisted"] = torch.zeros(4, dtype=torch.uint16)  # U16: not in the map
    save_file(tensors, str(tmp_path / "model.safetensors"))
    specs = checkpoint_specs(str(tmp_path))
    expected = {f"w.{str(d).removeprefix('torch.')}": ((2, 3), str(d).removeprefix("torch.")) for d in dtypes}
    assert specs == {**expected, "w.unlisted": ((4,), "U16")}


def test_checkpoint_specs_of_a_folder_without_model_safetensors_or_index_read_every_file(tmp_path: Path) -> None:
    """Kills M-16 (such a folder, a drafter saved under another file name, gave no tensors: every push to it was
    refused as unknown) and M-19 (the fallback caught the wrong error: CheckpointError escaped)."""
    from safetensors.torch import save_file

    from tlt.services.rollout.sglang_backend.model_info import checkpoint_specs

    save_file({"fc.weight": torch.zeros(8, 16, dtype=torch.bfloat16)}, str(tmp_path / "drafter.safetensors"))
    save_file({"norm.weight": torch.zeros(8)}, str(tmp_path / "extra.safetensors"))
    assert checkpoint_specs(str(tmp_path)) == {"fc.weight": ((8, 16), "bfloat16"), "norm.weight": ((8,), "float32")}


# -- services/trainer/run_env.py --------------------------------------------------------------


def test_every_service_sections_variables_are_folded_and_taken_out_of_the_children(
        monkeypatch: pytest.MonkeyPatch, no_tlt_environment: None) -> None:
    """Kills R-2, R-3, R-4 (the [sglang], [reward] or [drafter] variables left out: not folded into config.toml
    under --set, and still read by the children over it) and R-16 (variables that only start like a section's,
    one underscore, taken out too: a misspelt TLT_TRAINER_LR no longer reached a service to be named there, and
    the drafter's own TLT_DRAFTER_WORKER_CONFIG was dropped). Secrets stay out of the layer and in the children's
    environment unless --set names them."""
    from tlt.services.trainer.run_env import child_unset_env, environment_layer

    variables = dict(TLT_SGLANG__MEM_FRACTION_STATIC="0.5", TLT_REWARD__WORKERS="3",
                     TLT_DRAFTER__ROLLOUT_GRPC="127.0.0.1:1", TLT_DRAFTER__CONTROL_TOKEN="tok",
                     TLT_TRAINER__ROLLOUT_TOKEN="tok2", TLT_TRAINER_LR="1", TLT_DRAFTER_WORKER_CONFIG="/w.json")
    for k, v in variables.items():
        monkeypatch.setenv(k, v)
    assert sorted(environment_layer()) == [("drafter.rollout_grpc", "127.0.0.1:1"), ("reward.workers", 3),
                                           ("sglang.mem_fraction_static", 0.5)]
    assert child_unset_env({}) == ("TLT_DRAFTER__ROLLOUT_GRPC", "TLT_REWARD__WORKERS",
                                   "TLT_SGLANG__MEM_FRACTION_STATIC")
    assert child_unset_env({"drafter.control_token": "cli"}) == (
        "TLT_DRAFTER__CONTROL_TOKEN", "TLT_DRAFTER__ROLLOUT_GRPC", "TLT_REWARD__WORKERS",
        "TLT_SGLANG__MEM_FRACTION_STATIC")


def test_a_map_given_whole_stays_one_value_and_a_keyed_one_is_split(monkeypatch: pytest.MonkeyPatch,
                                                                    no_tlt_environment: None) -> None:
    """Kills R-8 (any table flattened): TLT_SGLANG__ADAPTIVE_STEPS='{...}' must replace the map (README: a table
    given whole replaces a dict-valued field), not set its keys one by one over the preset's."""
    from tlt.services.trainer.run_env import environment_layer

    monkeypatch.setenv("TLT_SGLANG__ADAPTIVE_STEPS", '{"1": [1, 3]}')
    assert environment_layer() == [("sglang.adaptive_steps", {"1": [1, 3]})]
    monkeypatch.delenv("TLT_SGLANG__ADAPTIVE_STEPS")
    monkeypatch.setenv("TLT_SGLANG__ADAPTIVE_STEPS__2", "[2, 4]")
    assert environment_layer() == [("sglang.adaptive_steps.2", [2, 4])]


@pytest.mark.parametrize("backend", ["tlt.services.rollout.engine.engine : LLMEngine", "pkg.mod:", ":Cls",
                                     "pkg..mod:Cls", "pkg.mod:Cls.sub", "pkg-mod:Cls"])
def test_a_malformed_module_class_backend_is_refused_by_the_config(backend: str) -> None:
    """The audit's one gap outside the tests: the config checked a 'module:Class' only for non-empty parts, so a
    stray space passed `tlt config check` and failed at the replica's start ("No module named '...engine '"),
    which `engine_class` imports as given. Now both parts must be Python identifiers (the module's dotted)."""
    from pydantic import ValidationError

    from tlt.services.rollout.config import RolloutConfig

    with pytest.raises(ValidationError, match="unknown rollout backend"):
        RolloutConfig(backend=backend)
    assert RolloutConfig(backend="tlt.services.rollout.engine.engine:LLMEngine").backend.endswith(":LLMEngine")
