"""[trainer] push dtype against [rollout.engine] dtype, checked before anything starts (`tlt config check`, `tlt run`).

`trainer.bf16 = true` on the cpu-tiny preset passed both, then every run died at its first weight push: push_dtype
"auto" pushes bf16 when the trainer trains bf16, and the native engine (float32 there) refused each of its 128 tensors
with a dtype error that named no fix. Nothing is started here: the checks read configs only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tlt.cli import main
from tlt.services.common.config import PRESETS_DIR, ConfigError
from tlt.services.trainer.launcher import _validate

FIX = 'trainer.push_dtype = "float32" or rollout.engine.dtype = "bfloat16"'


pytestmark = pytest.mark.usefixtures("no_tlt_environment")  # the caller's TLT_* variables: conftest.py


def test_bf16_training_against_a_float32_engine_is_refused_with_the_fix(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bf16.toml"
    bad.write_text("[trainer]\nbf16 = true\n")  # push_dtype auto -> bf16; the engine's default dtype: float32
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and FIX in err and "bfloat16" in err and "float32" in err, err
    with pytest.raises(ConfigError, match="push_dtype") as e:  # `tlt run`, before anything starts
        _validate({"trainer": {"bf16": True}, "rollout": {"engine": {"dtype": "float32"}}}, {"drafter": False})
    assert FIX in str(e.value) and "\n" not in str(e.value)
    # an explicit push dtype the engine does not serve: the same refusal
    with pytest.raises(ConfigError, match='push_dtype="float16"'):
        _validate({"trainer": {"push_dtype": "float16"}, "rollout": {"engine": {"dtype": "bfloat16"}}},
                  {"drafter": False})


@pytest.mark.parametrize("text", [
    "[trainer]\nbf16 = true\npush_dtype = 'float32'\n",  # either fix named
    "[trainer]\nbf16 = true\n[rollout.engine]\ndtype = 'bfloat16'\n",
    "[trainer]\nbf16 = true\nweight_push = 'none'\n",  # nothing pushed
    "[trainer]\nbf16 = true\n[rollout]\nbackend = 'sglang'\n",  # not the native engine's dtype
    "[trainer]\nbf16 = false\n",
    "[trainer]\nsteps = 3\n",  # bf16 unset: decided by the trainer's device, unknown here
])
def test_matching_or_unknowable_dtypes_pass(tmp_path: Path, capsys, text: str) -> None:
    ok = tmp_path / "ok.toml"
    ok.write_text(text)
    assert main(["config", "check", str(ok)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.toml")))
def test_every_shipped_preset_passes(preset: str, capsys) -> None:
    assert main(["config", "check", preset]) == 0, capsys.readouterr().err
